"""The scale model against every measured figure in results/model_inputs/scale_model_validation.json.

Each figure carries its measured value and names where it was read from (a row of a comm-bench
JSON, a run of a sweep JSON, a run's metrics.jsonl in the results/ archive, or a public number
with its source), so the model reads nothing outside results/model_inputs; tests/test_model_inputs.py
reads every value again from its file. It says what to predict the figure from (a recipe with
overrides, or a workload's fields, on a GPU). A new multi-GPU run joins the table by adding a row
there; nothing here changes.
"""

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from moe_comm.metrics import history
from moe_comm.predict import calibration, estimate, scale_model
from moe_comm.predict.assumptions import REPO, VALIDATION


# How a run's metrics.jsonl gives one figure (measured.reduce), over its steps after
# measured.after_step (a warm-up; 0: every step).
JSONL_REDUCE = {"max": max, "median": statistics.median, "last": lambda values: values[-1]}


def load_figures(path: Path = VALIDATION) -> list[dict]:
    return json.loads(path.read_text())["figures"]


def measured(fig: dict) -> float:
    m = fig["measured"]
    if "value" in m:
        return float(m["value"])
    path = REPO / m["file"]
    if path.suffix == ".jsonl":  # a run's metrics, one row per step as `report` reads them
        reduce = m.get("reduce", "max")
        if reduce not in JSONL_REDUCE:
            raise ValueError(f"{fig['id']}: measured.reduce {reduce!r} is not one of {sorted(JSONL_REDUCE)}")
        rows = history.newest_rows(path.read_text().splitlines())
        values = [r[m["field"]] for r in rows if r["step"] > m.get("after_step", 0) and r.get(m["field"]) is not None]
        if not values:
            raise ValueError(f"{fig['id']}: no {m['field']!r} in {m['file']}")
        return float(JSONL_REDUCE[reduce](values))
    data = json.loads(path.read_text())
    if "path" in m:
        for key in m["path"]:
            data = data[key]
        return float(data)
    if "row" in m:
        rows = [r for r in data["rows"] if all(r.get(k) == v for k, v in m["row"].items())]
        if len(rows) != 1:
            raise ValueError(f"{fig['id']}: {len(rows)} rows of {m['file']} match {m['row']}")
        return float(rows[0][m["field"]])
    runs = [r for r in data["runs"] if r["name"] == m["run"]]
    if len(runs) != 1 or runs[0].get("status") != "ok":
        raise ValueError(f"{fig['id']}: run {m['run']!r} of {m['file']} missing or not ok")
    return float(runs[0]["summary"][m["field"]])


def _bench_row(fig: dict) -> dict:
    p, m = fig["predict"], fig["measured"]
    if "row" in p:
        return p["row"]
    data = json.loads((REPO / m["file"]).read_text())
    return next(r for r in data["rows"] if all(r.get(k) == v for k, v in m["row"].items()))


def predicted(fig: dict, cal: calibration.Calibration) -> float:
    p = fig["predict"]
    q = p["quantity"]
    if fig["kind"] == "comm_bench":
        r = _bench_row(fig)
        cluster = scale_model.cluster_for(p["gpu"], 1, r["world"], cal)
        out = scale_model.bench_round_trip(p["backend"], r["tokens"], r["hidden"], r["top_k"], r["experts"],
                                           r["routing"], r["world"], p.get("num_sms", 20), cluster, cal)
        if q.endswith("_transport_us"):  # DeepEP's own figure: no expert-major layout, no host sync
            t = out["transfers"][0 if q.startswith("dispatch") else 1]
            return t.fixed_us + max(t.nvlink_us, t.network_us)
        return out[q]
    w, cluster = scale_model.workload_from_spec(p, cal)
    if fig["kind"] == "memory":
        # with predict.backend: as `check` estimates a run of that backend now (what its recompute
        # keeps of the comm, its MoE calls' CUDA graph pools); without: the model's activations and
        # states alone, as the runs made before those existed held them
        mem = (scale_model.memory(w, p["backend"]) if "backend" in p else
               estimate.memory_per_gpu(w.args, w.layout, w.local_batch, w.seq_len, w.ac_mode, microbatch=w.microbatch))
        return (mem.total if q == "memory_in_use_gib" else mem.reserved) / estimate.GiB
    return getattr(scale_model.predict(p["backend"], w, cluster, cal, p.get("dispatch_dtype", "bf16")), q)


@dataclass
class Row:
    id: str
    kind: str
    machine: str
    use: str
    measured: float
    predicted: float
    note: str

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted / self.measured - 1.0)


def validate(cal: calibration.Calibration, figures: list[dict] | None = None) -> list[Row]:
    rows = []
    for fig in figures if figures is not None else load_figures():
        rows.append(Row(fig["id"], fig["kind"], fig["machine"], fig["use"], measured(fig), predicted(fig, cal),
                        fig.get("note", "")))
    return rows


def fit_allocator_cache(figures: list[dict] | None = None, *, sharded: bool = True) -> float:
    """Bytes of allocator cache per output-projection parameter (vocab x dim / tp) that best
    explain reserved - in use over the memory figures whose reserved figure calibrates (least
    squares through 0), of the runs under fully_shard (`sharded`) or of those without it: the
    values moe_comm.predict.estimate.ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM and
    ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM_UNSHARDED must match."""
    figures = figures if figures is not None else load_figures()
    pairs = {}
    for fig in figures:
        if fig["kind"] != "memory":
            continue
        key = fig["measured"]["file"]
        pairs.setdefault(key, {})[fig["predict"]["quantity"]] = (fig, measured(fig))
    sxy = sxx = 0.0
    for both in pairs.values():
        if {"memory_in_use_gib", "memory_reserved_gib"} - set(both) or \
                not both["memory_reserved_gib"][0]["use"].startswith("calibration"):
            continue  # a held-out reserved figure checks the fit, it never moves it
        fig = both["memory_in_use_gib"][0]
        w, _ = scale_model.workload_from_spec(fig["predict"])
        if estimate.fsdp_applied(w.layout) != sharded:
            continue
        x = w.args.vocab_size * w.args.dim / w.layout.tp
        gap = (both["memory_reserved_gib"][1] - both["memory_in_use_gib"][1]) * estimate.GiB
        sxy += x * gap
        sxx += x * x
    return sxy / sxx
