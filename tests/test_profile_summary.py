"""experiments/profile_summary.py: the top kernels by name, and who launched them."""

from experiments.profile_summary import launchers_ms, top_kernels_ms


def test_kernels_whose_names_share_the_listed_prefix_are_summed():
    family = "cutlass_grouped_gemm_" + "x" * 150
    by_name = {family + "_tile_a": 15_000.0, family + "_tile_b": 35_000.0, "optimizer": 40_000.0}
    top = top_kernels_ms(by_name)
    assert top == {family[:160]: 50.0, "optimizer": 40.0}


def _x(cat, name, ts, dur, tid=1, correlation=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_kernels_are_charged_to_the_annotation_and_op_around_their_launch():
    events = [
        # the main thread: a forward annotation, an op inside it that launches two kernels
        _x("user_annotation", "fwd:layers.1.moe", 0, 100),
        _x("cpu_op", "moe_comm::fp8_gate", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 2, correlation=7),
        _x("cuda_runtime", "cudaLaunchKernel", 16, 2, correlation=8),
        _x("cpu_op", "aten::add", 40, 10),  # after the op closed: its own launch
        _x("cuda_driver", "cuLaunchKernel", 42, 2, correlation=9),
        # autograd's thread: a node whose op zero-fills
        _x("cpu_op", "autograd::engine::evaluate_function: _DispatchFp8RowsBackward", 200, 100, tid=2),
        _x("cpu_op", "_DispatchFp8RowsBackward", 201, 98, tid=2),
        _x("cpu_op", "aten::fill_", 210, 10, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 212, 2, tid=2, correlation=10),
        # the kernels on the GPU's timeline
        _x("kernel", "gate_kernel", 50, 300, tid=7, correlation=7),
        _x("kernel", "gate_kernel", 400, 100, tid=7, correlation=8),
        _x("kernel", "add_kernel", 500, 50, tid=7, correlation=9),
        _x("gpu_memset", "Memset (Device)", 600, 20, tid=7, correlation=10),
        _x("kernel", "orphan_kernel", 700, 10, tid=7, correlation=99),
        _x("kernel", "outside_kernel", 2000, 10, tid=7, correlation=7),
    ]
    got = launchers_ms(events, span_start=0, span_end=1000)
    assert got == {
        "fwd:layers.1.moe > moe_comm::fp8_gate | gate_kernel": 0.4,
        "fwd:layers.1.moe > aten::add | add_kernel": 0.05,
        "autograd::engine::evaluate_function: _DispatchFp8RowsBackward > aten::fill_ | Memset (Device)": 0.02,
        "? | orphan_kernel": 0.01,
    }
