"""The one-GPU same-run table (issue 25): tokens/s, MFU, memory and the MoE layer's local work
(the backend's dispatch and combine, forward and backward, CUDA events on the compute stream)
per run of recipes/deepseek_v3_671b_h200x1.toml, from each run's metrics.jsonl, and where a
profiled step's GPU time went (experiments/profile_summary.py's JSON of that run).

    python experiments/one_gpu_table.py results/h200x1/one_gpu_training

Steps 1-10 (start-up, warm-up) and the profiled steps (150, 300) are left out of the medians.
"""

import json
import statistics
import sys
from pathlib import Path

from moe_comm.metrics import keys

SKIP_FIRST = 10
PROFILED = {150, 300}
PHASES = (keys.DISPATCH_FWD_MS, keys.DISPATCH_BWD_MS, keys.COMBINE_FWD_MS, keys.COMBINE_BWD_MS)


def run_row(folder: Path) -> dict:
    recs = [json.loads(line) for line in (folder / keys.JSONL_NAME).read_text().splitlines() if line.strip()]
    steady = [r for r in recs if r["step"] > SKIP_FIRST and r["step"] not in PROFILED]
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    row = {"run": folder.name, "backend": recs[0][keys.BACKEND], "dispatch_dtype": recs[0][keys.BACKEND_OPTIONS].get(
        "dispatch_dtype"), "steps": recs[-1]["step"], "steps_in_medians": len(steady),
        "tok_s": med(keys.TPS), "mfu_pct": med(keys.MFU),
        "mem_active_gib": max(r[keys.MEM_ACTIVE] for r in recs),
        "mem_reserved_gib": max(r[keys.MEM_RESERVED] for r in recs),
        "step_s": med(keys.STEP_TIME_TT), "final_loss": recs[-1][keys.LOSS]}
    for p in PHASES:
        row[p.removeprefix(keys.PREFIX)] = med(p)
    row["local_work_ms"] = sum(row[p.removeprefix(keys.PREFIX)] for p in PHASES)
    return row


def pairs(rows: list[dict], base: str = "nccl_bf16", other: str = "nvshmem_fp8") -> list[dict]:
    """Each `other` run's tok/s over the `base` run of the same variant (the name after the
    prefix: "" / "_again", "_compiled", "_loss_compiled", ...), as a call's runs are named."""
    by_name = {r["run"]: r for r in rows}
    out = []
    for r in rows:
        variant = r["run"].removeprefix(other)
        b = by_name.get(base + variant) if r["run"].startswith(other) else None
        if b:
            out.append({"variant": variant or "-", "base": b["run"], "run": r["run"], "ratio": r["tok_s"] / b["tok_s"]})
    return out


def main() -> int:
    root = Path(sys.argv[1])
    rows = [run_row(f) for f in sorted((root / "runs").iterdir()) if (f / keys.JSONL_NAME).is_file()]
    print("| run | backend | tok/s | MFU | step s | final loss | max active GiB | max reserved GiB | "
          "dispatch fwd+bwd ms | combine fwd+bwd ms | MoE local work ms/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['backend']} {r['dispatch_dtype']} | {r['tok_s']:,.0f} | {r['mfu_pct']:.1f}% | "
              f"{r['step_s']:.3f} | {r['final_loss']:.4f} | {r['mem_active_gib']:.1f} | {r['mem_reserved_gib']:.1f} | "
              f"{r['dispatch_fwd_ms']:.2f} + {r['dispatch_bwd_ms']:.2f} | {r['combine_fwd_ms']:.2f} + "
              f"{r['combine_bwd_ms']:.2f} | {r['local_work_ms']:.2f} |")
    ratios = pairs(rows)
    if ratios:
        print("\n| variant | nvshmem FP8 / nccl bf16 tok/s |\n| --- | --- |")
        for q in ratios:
            print(f"| {q['variant']} | {q['ratio']:.3f} |")
    out = {"rows": rows, "pairs": ratios, "profiles": {}}
    for prof in sorted((root / "profiles").glob("*.json")):
        p = json.loads(prof.read_text())
        out["profiles"][prof.stem] = {"span_ms": p["span_ms"], "kernel_time_share": p["kernel_time_share"],
                                      "gpu_idle_share": p["gpu_idle_share"]}
    (root / "table.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
