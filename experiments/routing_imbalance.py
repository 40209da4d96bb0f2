"""The busiest EP rank's routed load over the mean, from a real run's per-expert token counts.

    python experiments/routing_imbalance.py OUT/expert_counts/rank*.jsonl --out results/h200x1/routing_imbalance
    (writes routing_imbalance.json and routing_imbalance.md there)

Input: the files `[moe_comm] log_expert_counts = true` writes (moe_comm.metrics.expert_counts), one
per rank; a step's counts are summed over the files given (all of a run's tokens). The run must
have trained with TorchTitan's aux-loss-free bias on (load_balance_coeff set: the DeepSeek-V3
flavors' default); --allow-unbalanced reads one without it.

Placement: TorchTitan puts experts on EP ranks in contiguous blocks (rank r holds experts
r * E / ep .. (r + 1) * E / ep - 1; ExpertParallel shards the experts' dim 0). A rank's load is its
block's routed (token, expert) rows; the figure is max over ranks / mean over ranks, per MoE
layer and step, then its distribution over steps (median, p90, max).

Mapping to the flagship (256 experts) from a run with E experts (the one-GPU recipe: 32): a rank at
EP X holds 256 / X experts, a 1 / X share of them; it is taken to carry what a contiguous block
of E / X of the measured experts carries - the same share of the experts, the same number of
ranks. With E = 32: EP 8 = blocks of 4 (which is also one node-limited routing group in both
models: 8 groups), EP 32 = single experts. EP 64 would need half an expert: not derivable; since
max / mean cannot fall when every rank's block splits in two, the EP 32 figure is its lower bound,
and that is all that is given. What this does not capture, stated beside the figures: a flagship
rank at EP 32 sums 8 experts where the measured rank has 1 (independent skews would partly
average out, so the mapping leans pessimistic there), and a step of this run routes fewer tokens
than one flagship dispatch (sampling noise: the uniform-routing floor at the run's own token count
is given beside each figure).
"""

import argparse
import datetime
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

SCHEMA = "routing_imbalance/1"
FLAGSHIP_EXPERTS = 256
FLAGSHIP_EPS = (8, 32, 64)
NOISE_DRAWS = 64


def read_counts(paths: list[Path]) -> tuple[dict, dict[int, torch.Tensor]]:
    """(the run line, {step: [layers, experts] counts summed over the files}). A step logged twice
    by one rank (a requeued run appends) keeps its last line; every file must hold the same steps
    and layers."""
    run, per_file = None, []
    for path in paths:
        header, steps = None, {}
        for n, line in enumerate(open(path), 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("kind") == "run":
                header = rec
            elif rec.get("kind") == "step":
                steps[rec["step"]] = rec["counts"]
            else:
                raise ValueError(f"{path}:{n}: not an expert_counts line (kind {rec.get('kind')!r})")
        if header is None or not steps:
            raise ValueError(f"{path}: no run line or no steps: not a log of [moe_comm] log_expert_counts")
        if run is None:
            run = header
        elif (header["layers"], header["num_experts"]) != (run["layers"], run["num_experts"]):
            raise ValueError(f"{path}: other layers or experts than {paths[0]} ({header['layers']}, "
                             f"{header['num_experts']} experts): logs of different runs or pipeline stages")
        per_file.append((path, steps))
    common = set.intersection(*(set(s) for _, s in per_file))
    missing = {str(p): sorted(set(s) - common)[:5] for p, s in per_file if set(s) - common}
    if missing:
        raise ValueError(f"steps not in every file (a rank stopped early?): {missing}")
    total = {step: sum(torch.tensor(s[step], dtype=torch.float64) for _, s in per_file) for step in sorted(common)}
    return run, total


def busiest_over_mean(counts_LE: torch.Tensor, ranks: int) -> torch.Tensor:
    """Per layer: the most loaded rank's rows over the mean rank's, experts in contiguous blocks."""
    per_rank = counts_LE.view(counts_LE.shape[0], ranks, -1).sum(-1)
    return per_rank.max(-1).values / per_rank.mean(-1)


def _dist(values: list[float]) -> dict:
    s = sorted(values)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "max": s[-1],
            "mean": statistics.fmean(s), "samples": len(s)}


def noise_floor(tokens: int, experts: int, top_k: int, ranks: int, seed: int = 0) -> dict:
    """The busiest-rank ratio uniform routing gives at this token count (each token picks top_k
    distinct experts uniformly): the part of a measured figure that sampling noise alone makes."""
    g = torch.Generator().manual_seed(seed)
    ratios = []
    for _ in range(NOISE_DRAWS):
        picks = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.flatten()
        counts = torch.bincount(picks, minlength=experts).double().view(1, -1)
        ratios.append(busiest_over_mean(counts, ranks).item())
    return _dist(ratios)


def analyse(run: dict, counts: dict[int, torch.Tensor], skip_steps: int = 0, allow_unbalanced: bool = False) -> dict:
    if run.get("load_balance_coeff") is None and not allow_unbalanced:
        raise ValueError("the run trained without TorchTitan's aux-loss-free bias (load_balance_coeff None): its "
                         "routing is not what the flagship's flavor trains with; --allow-unbalanced to read it anyway")
    E, top_k, layers = run["num_experts"], run["top_k"], run["layers"]
    steps = [s for s in sorted(counts) if s > skip_steps]
    if not steps:
        raise ValueError(f"no steps after --skip-steps {skip_steps} (the log has {min(counts)}..{max(counts)})")
    tokens = int(counts[steps[0]][0].sum().item()) // top_k  # per step, every rank's
    out = {"layers": layers, "experts": E, "top_k": top_k, "tokens_per_step": tokens,
           "steps": {"first": steps[0], "last": steps[-1], "count": len(steps), "skipped_up_to": skip_steps},
           "ep": {}}
    half = len(steps) // 2
    for ep in FLAGSHIP_EPS:
        per_rank_flagship = FLAGSHIP_EXPERTS // ep
        entry = {"flagship_experts_per_rank": per_rank_flagship, "share_of_experts": f"1/{ep}"}
        if E % ep:
            lower = max((x for x in FLAGSHIP_EPS if x < ep and E % x == 0), default=None)
            entry.update(derivable=False, measured_experts_per_rank=E / ep,
                         why=f"a 1/{ep} share of {E} experts is {E / ep:g} experts: a rank would hold part of one",
                         lower_bound_from_ep=lower,
                         lower_bound=out["ep"][str(lower)]["all_layers"] if lower else None)
            out["ep"][str(ep)] = entry
            continue
        ratios_SL = torch.stack([busiest_over_mean(counts[s], ep) for s in steps])  # [steps, layers]
        entry.update(derivable=True, ranks=ep, measured_experts_per_rank=E // ep,
                     per_layer={str(name): _dist(ratios_SL[:, i].tolist()) for i, name in enumerate(layers)},
                     all_layers=_dist(ratios_SL.flatten().tolist()),
                     busiest_layer_per_step=_dist(ratios_SL.max(dim=1).values.tolist()),
                     halves={"first": statistics.median(ratios_SL[:half].flatten().tolist()) if half else None,
                             "second": statistics.median(ratios_SL[half:].flatten().tolist())},
                     uniform_routing_floor=noise_floor(tokens, E, top_k, ep))
        out["ep"][str(ep)] = entry
    return out


def markdown(doc: dict) -> str:
    a, run = doc["analysis"], doc["run"]
    lines = [
        f"Routing imbalance from `{run.get('recipe')}` (flavor {run.get('flavor')}; {a['experts']} experts, top-{a['top_k']}, "
        f"MoE layers {', '.join(map(str, a['layers']))}), aux-loss-free bias coefficient {run.get('load_balance_coeff')}; "
        f"steps {a['steps']['first']}-{a['steps']['last']} ({a['steps']['count']}), {a['tokens_per_step']:,} tokens a step "
        f"over {len(doc['inputs'])} rank file(s). Command: `{doc['command']}` ({doc['date']}).",
        "",
        "Busiest EP rank's routed rows over the mean rank's, experts placed as TorchTitan places them (contiguous "
        "blocks); a flagship rank at EP X is read as a contiguous 1/X share of the measured experts. Per layer and "
        "step; distribution over steps. The uniform-routing floor is what sampling noise alone gives at this run's "
        "token count.",
        "",
        "| flagship EP (experts/rank of 256) | measured experts/rank | layer | median | p90 | max | uniform floor (median) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ep, e in a["ep"].items():
        head = f"| {ep} ({e['flagship_experts_per_rank']}) | {e['measured_experts_per_rank']:g} |"
        if not e["derivable"]:
            lb = e["lower_bound"]
            bound = (f"at least EP {e['lower_bound_from_ep']}'s: {lb['median']:.3f} / {lb['p90']:.3f} / {lb['max']:.3f}"
                     if lb else "no lower bound either")
            lines.append(f"{head} all | not derivable ({e['why']}); {bound} (max / mean cannot fall when every rank's "
                         "block splits) | | | |")
            continue
        floor = e["uniform_routing_floor"]["median"]
        for name, d in [*e["per_layer"].items(), ("all", e["all_layers"]), ("busiest layer", e["busiest_layer_per_step"])]:
            lines.append(f"{head} {name} | {d['median']:.3f} | {d['p90']:.3f} | {d['max']:.3f} | {floor:.3f} |")
    lines += ["", "Median over the first and second half of the steps (the bias converging): " + "; ".join(
        f"EP {ep}: {e['halves']['first']:.3f} -> {e['halves']['second']:.3f}" for ep, e in a["ep"].items()
        if e["derivable"] and e["halves"]["first"] is not None) + ".", "",
        "Not captured: " + "; ".join(
            f"a flagship rank at EP {ep} sums {e['flagship_experts_per_rank']} experts where the measured one has "
            f"{e['measured_experts_per_rank']:g}" for ep, e in a["ep"].items() if e["derivable"]
            and e["flagship_experts_per_rank"] > e["measured_experts_per_rank"])
        + " (independent skews would partly average out over more experts: the mapping leans pessimistic); one "
        "step here routes fewer tokens than one flagship dispatch (see the floor)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path, help="expert_counts/rank*.jsonl of one run")
    p.add_argument("--out", type=Path, required=True, help="folder for routing_imbalance.json and .md")
    p.add_argument("--skip-steps", type=int, default=0, help="leave out steps up to this one (the bias warming up)")
    p.add_argument("--allow-unbalanced", action="store_true", help="read a run without the aux-loss-free bias")
    args = p.parse_args(argv)
    try:
        run, counts = read_counts(args.logs)
        analysis = analyse(run, counts, args.skip_steps, args.allow_unbalanced)
    except (ValueError, OSError) as e:
        print(f"routing_imbalance: {e}", file=sys.stderr)
        return 1
    doc = {"schema": SCHEMA, "command": shlex.join(["python", "experiments/routing_imbalance.py", *argv]),
           "date": datetime.date.today().isoformat(), "inputs": [str(x) for x in args.logs], "run": run,
           "mapping": __doc__.split("Mapping to the flagship")[1].split("\n\n")[0].strip(), "analysis": analysis}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_imbalance.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "routing_imbalance.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
