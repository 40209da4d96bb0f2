"""A made-up layer benchmark (every part's time invented and distinct, so a wrong pick shows and
each rule can be redone on paper), in the JSON schema experiments/layer_bench.py writes, for the
tests of moe_comm.predict.layer_compute and of the step model that prices compute from it."""

import functools
import json
import tempfile
from pathlib import Path

from moe_comm.predict import documents, layer_compute
from moe_comm.predict.calibration import Calibration, OpCost
from moe_comm.predict.routing_plan import routing_statistics

DOCS = ("docs512", "c4_en", "nltk_en")  # the block-causal kernels' document variants
NAMES = ["rmsnorm", "residual_add", "router", "embedding", "shared_expert", "dense_ffn", "output_loss",
         "attention.module.flex", "attention.core.flex", "attention.module.sdpa", "attention.core.sdpa",
         "attention.module.varlen", "attention.core.varlen",
         *[f"attention.core.{k}.{d}" for k in ("flex", "varlen") for d in DOCS],
         *[f"experts.{d}.{r}" for d in ("bf16", "fp8", "fp8.compiled", "moe_comm_fp8", "moe_comm_fp8_bf16_wgrad")
           for r in ("balanced", "node_limited")],
         "output_loss.loss_compiled"]
# made-up (fwd ms, bwd ms, recompute ms) per part: distinct so a wrong pick shows
TIMES = {n: (1.0 + i, 2.0 * (1.0 + i), 1.5 + i) for i, n in enumerate(NAMES)}
for impl in ("flex", "sdpa", "varlen"):  # the module holds its kernel: 5 ms more forward, 9 backward, 4 recompute
    core = TIMES[f"attention.core.{impl}"]
    TIMES[f"attention.module.{impl}"] = (core[0] + 5.0, core[1] + 9.0, core[2] + 4.0)
CEILINGS = {"bf16_gemm": {"tflops": 700.0}, "fp8_rowwise_gemm": {"tflops": 1100.0}, "copy": {"tbs": 4.2}}
# the FP8 experts' steps by kind (experiments/layer_bench.py FP8_STEP_KINDS): a quarter of the
# time quantisation (memory-bound), the rest GEMMs
FP8_KINDS = {"quantise": 1.0, "gemm_fwd": 1.0, "gemm_dgrad": 1.0, "wgrad_operands": 0.0, "gemm_wgrad": 1.0}


def _case(name, seq, tp, routing):
    tokens_sp = seq // tp
    rows = {}
    for r in ("balanced", "node_limited"):
        st = routing_statistics(r, 32, 8, 256, 8)
        rows[r] = {"rows": st.max["expert_rows"] * tokens_sp}
    return {"name": name, "flavor": "671B", "seq_len": seq, "sequences": 1, "tp": tp, "ep": 32, "routing": routing,
            "tokens": seq, "tokens_sp": tokens_sp, "received_rows": rows}


def kept_pairs(seq: int, docs: str | None) -> float:
    """The (query, key) pairs the bench's attention kernel keeps in its one sequence of `seq`
    tokens: one document, 512-token ones, or a distribution packed as TorchTitan packs it (seed 0),
    as experiments/layer_bench.py draws them."""
    if docs is None:
        return seq * (seq + 1) / 2
    if docs == "docs512":
        return seq // 512 * 512 * 513 / 2
    dist = documents.C4_EN if docs == "c4_en" else documents.load_measured()[docs]
    return documents.kept_pairs(documents.packed(dist, 1, seq, seed=0)[0])


def _part(case, name, t, status="ok", seq=4096, heads=128):
    p = {"case": case, "name": name, "status": status,
         "ms": {"fwd": {"median": t[0]}, "bwd": {"median": t[1]}, "recompute": t[2]}}
    if name.startswith("attention.core."):  # its flop count names its documents (2 x heads x pairs x 320)
        docs = name.split(".")[3] if name.count(".") == 3 else None
        p["flops"] = {"fwd": 2 * heads * kept_pairs(seq, docs) * 320}
    if ".moe_comm_fp8" in name:
        p["breakdown"] = {"kinds_ms": FP8_KINDS}
    return p


def write_bench(path: Path, skip: tuple = (), cases: tuple = ("flagship", "nebius")) -> layer_compute.LayerBench:
    """The made-up benchmark at `path` (the Nebius case's parts 3x the flagship's); parts named in
    `skip` are recorded as not run, as a device run that ran out of time leaves them; `cases`: the
    cases it ran (the flagship's alone, as the device run of issue 34 did)."""
    shapes = {"flagship": (4096, 1, "node_limited", 1.0), "nebius": (8192, 2, "balanced", 3.0)}
    cases = {c: _case(c, *shapes[c][:3]) for c in cases}
    parts = [_part(c, n, (t[0] * shapes[c][3], t[1] * shapes[c][3], t[2] * shapes[c][3]),
                   "not run" if n in skip else "ok", shapes[c][0], 128 // shapes[c][1])
             for c in cases for n, t in TIMES.items()]
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
