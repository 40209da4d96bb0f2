"""A made-up layer benchmark (every part's time invented and distinct, so a wrong pick shows and
each rule can be redone on paper), in the JSON schema experiments/layer_bench.py writes, for the
tests of moe_comm.predict.layer_compute and of the step model that prices compute from it."""

import functools
import json
import tempfile
from pathlib import Path

from moe_comm.predict import layer_compute
from moe_comm.predict.calibration import Calibration, OpCost
from moe_comm.predict.routing_plan import routing_statistics

NAMES = ["rmsnorm", "residual_add", "router", "embedding", "shared_expert", "dense_ffn", "output_loss",
         "attention.module.flex", "attention.core.flex", "attention.module.sdpa", "attention.core.sdpa",
         *[f"experts.{d}.{r}" for d in ("bf16", "fp8", "fp8.compiled") for r in ("balanced", "node_limited")]]
# made-up (fwd ms, bwd ms, recompute ms) per part: distinct so a wrong pick shows
TIMES = {n: (1.0 + i, 2.0 * (1.0 + i), 1.5 + i) for i, n in enumerate(NAMES)}
for impl in ("flex", "sdpa"):  # the module holds its kernel: 5 ms more forward, 9 backward, 4 recompute
    core = TIMES[f"attention.core.{impl}"]
    TIMES[f"attention.module.{impl}"] = (core[0] + 5.0, core[1] + 9.0, core[2] + 4.0)
CEILINGS = {"bf16_gemm": {"tflops": 700.0}, "fp8_rowwise_gemm": {"tflops": 1100.0}, "copy": {"tbs": 4.2}}


def _case(name, seq, tp, routing):
    tokens_sp = seq // tp
    rows = {}
    for r in ("balanced", "node_limited"):
        st = routing_statistics(r, 32, 8, 256, 8)
        rows[r] = {"rows": st.max["expert_rows"] * tokens_sp}
    return {"name": name, "flavor": "671B", "seq_len": seq, "sequences": 1, "tp": tp, "ep": 32, "routing": routing,
            "tokens": seq, "tokens_sp": tokens_sp, "received_rows": rows}


def _part(case, name, t, status="ok"):
    return {"case": case, "name": name, "status": status,
            "ms": {"fwd": {"median": t[0]}, "bwd": {"median": t[1]}, "recompute": t[2]}}


def write_bench(path: Path, skip: tuple = ()) -> layer_compute.LayerBench:
    """The made-up benchmark at `path` (the Nebius case's parts 3x the flagship's); parts named in
    `skip` are recorded as not run, as a device run that ran out of time leaves them."""
    cases = {"flagship": _case("flagship", 4096, 1, "node_limited"), "nebius": _case("nebius", 8192, 2, "balanced")}
    parts = [_part(c, n, (t[0] * k, t[1] * k, t[2] * k), "not run" if n in skip else "ok")
             for c, k in (("flagship", 1.0), ("nebius", 3.0)) for n, t in TIMES.items()]
    doc = {"schema": layer_compute.SCHEMA, "settings": {"tiny": False}, "machine": {"device": "NVIDIA H200"},
           "peaks": {"measured": CEILINGS}, "cases": cases, "parts": parts}
    path.write_text(json.dumps(doc))
    return layer_compute.load(path)


def hand_calibration(bench=None) -> Calibration:
    """Made-up communication constants (the compute comes from `bench`)."""
    return Calibration(
        p2p_gbps=400.0, nvlink_copy_efficiency=1.0, kernel_floor_us=10.0,
        ops={"dispatch": OpCost(0.5, 1.0), "combine": OpCost(0.25, 2.0)},
        deepep_ops={"dispatch": OpCost(0.5, 3.0), "combine": OpCost(0.25, 4.0)},
        expand=(0.001, 0.002), reduce=(0.003, 0.004), layout_hbm_efficiency=0.5,
        nccl_call_us=1000.0, nccl_row_us=0.02, nccl_backward_row_us=0.04, idle_ratio=0.1, layer_bench=bench,
    )


@functools.lru_cache(maxsize=None)
def made_up_bench() -> layer_compute.LayerBench:
    """One made-up benchmark per test process, in a temporary folder."""
    return write_bench(Path(tempfile.mkdtemp(prefix="layer_bench_")) / "layer_bench.json")
