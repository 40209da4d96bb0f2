"""experiments/profile_summary.py: the top kernels by name."""

from experiments.profile_summary import top_kernels_ms


def test_kernels_whose_names_share_the_listed_prefix_are_summed():
    family = "cutlass_grouped_gemm_" + "x" * 150
    by_name = {family + "_tile_a": 15_000.0, family + "_tile_b": 35_000.0, "optimizer": 40_000.0}
    top = top_kernels_ms(by_name)
    assert top == {family[:160]: 50.0, "optimizer": 40.0}
