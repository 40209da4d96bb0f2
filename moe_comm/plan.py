"""`python -m moe_comm plan RECIPE [--nodes N] [--gpu B200] [--backend X] [--keep ep=32] [--top 10]`:
the layouts a recipe could run on a cluster, ranked per backend by the scale model's tokens/s
per GPU, each with the overrides that select it and what bounds it (moe_comm.predict.plan).
Predictions, not measurements: results/scale_model.md lists what the model assumes."""

import argparse
import sys

from moe_comm import gpus, recipe
from moe_comm.predict import calibration, scale_model
from moe_comm.predict import plan as planner


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe TOML file")
    _add_flags(parser)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="TorchTitan overrides applied to the recipe first")


def whole_number(text: str) -> int:
    """argparse type of a count (nodes, GPUs, rows): a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return n


def _share(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a share of the GPU's memory in [0, 1), e.g. 0.15")
    return x


def _add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=whole_number, default=None, help="nodes of the cluster (default: [cluster] nodes)")
    parser.add_argument("--gpus-per-node", type=whole_number, default=None, help="default: [cluster] gpus_per_node")
    parser.add_argument("--gpu", default=None, type=gpus.model_name, choices=gpus.MODELS,
                        help="default: [cluster] gpu (any case)")
    parser.add_argument("--backend", action="append", default=None, choices=[c.label for c in scale_model.choices()],
                        help="rank this backend only (repeatable; default: all)")
    parser.add_argument("--keep", action="append", default=[], metavar="KEY=VALUE",
                        help=f"hold a choice fixed (repeatable); KEY one of {sorted(planner.KEEP_KEYS)}")
    parser.add_argument("--top", type=whole_number, default=10, help="rows per backend (default 10)")
    parser.add_argument("--global-tokens", default=None, metavar="MIN-MAX",
                        help="global batch range in tokens, e.g. 1M-4M (default: the recipe's, up to 4x)")
    parser.add_argument("--headroom", type=_share, default=0.15,
                        help="share of GPU memory left free (default 0.15: at most 85%% in use)")
    parser.add_argument("--explain", action="store_true",
                        help="for the recipe as it stands, where its TFLOPS/GPU fall short of Megatron-Bridge's on "
                             "the same 256 B200 (3,328 tok/s/GPU), on Megatron's flop count")


def _tokens(word: str) -> float:
    scale = {"K": 1e3, "M": 2**20, "G": 2**30}.get(word[-1:].upper(), 1)
    return float(word[:-1] if scale != 1 else word) * scale


def token_span(global_tokens: str | None) -> tuple[float, float]:
    """--global-tokens "MIN-MAX" as (min, max) tokens; (0, 0) when not given (PlanError if bad)."""
    if not global_tokens:
        return (0.0, 0.0)
    lo, sep, hi = global_tokens.partition("-")
    try:
        span = (_tokens(lo), _tokens(hi))
    except ValueError:
        sep = ""
    if not sep or not 0 < span[0] <= span[1]:
        raise planner.PlanError(f"--global-tokens {global_tokens!r}: write MIN-MAX in tokens, e.g. 1M-4M")
    return span


def request(r: recipe.Recipe, nodes: int | None = None, gpus_per_node: int | None = None, gpu: str | None = None,
            backends=None, keep: list[str] = (), global_tokens: str | tuple | None = None,
            headroom: float = 0.15) -> planner.Request:
    """A plan request for a loaded recipe (PlanError for a bad --keep or range); global_tokens
    is "MIN-MAX" as typed, or a (min, max) pair."""
    c = r.config
    base = scale_model.workload_from_recipe(r)
    gpu = gpu or c.cluster.gpu
    if not gpu:
        raise planner.PlanError("the recipe names no [cluster] gpu: pass --gpu (one of " + ", ".join(gpus.MODELS) + ")")
    span = global_tokens if isinstance(global_tokens, tuple) else token_span(global_tokens)
    par = c.parallelism
    values = {
        "nodes": r.layout.nodes, "pp": r.layout.pp, "ep": r.layout.ep, "local_batch": c.training.local_batch_size,
        "ac": c.activation_checkpoint.mode, "dispatch_dtype": c.moe_comm.dispatch_dtype,
        "schedule": par.pipeline_parallel_schedule, "microbatch": par.pipeline_parallel_microbatch_size,
        "layers_per_stage": par.pipeline_parallel_layers_per_stage,
        "dualpipe_overlap": par.pipeline_parallel_expert_parallel_overlap, "overlap": c.moe_comm.overlap,
    }
    return planner.Request(
        base=base, gpu=gpu, nodes=r.layout.nodes if nodes is None else nodes,
        gpus_per_node=r.layout.procs_per_node if gpus_per_node is None else gpus_per_node,
        recv_capacity_factor=c.moe_comm.recv_capacity_factor, recipe_values=values,
        keep=planner.parse_keep(list(keep)), backends=planner.backend_choices(backends or []),
        global_tokens=span, headroom=headroom,
    )


def describe(row: planner.Row) -> str:
    lay = row.layout
    pp = f"PP {lay.pp} {lay.schedule} x{lay.v}" if lay.pp > 1 else "PP 1"
    return (f"{pp}, EP {lay.ep}, mb {lay.microbatch} x {lay.microbatches}, AC {lay.ac}, overlap {lay.overlap}")


def table(rows_by_backend: dict, req: planner.Request) -> list[str]:
    lines = []
    choices = {c.label: c for c in req.backends}
    for backend, rows in rows_by_backend.items():
        if not rows:
            c = choices[backend]
            why = scale_model.refusal(c.backend, req.base, c.dispatch_dtype) or "nothing fits"
            lines.append(f"{backend}: no feasible layout: {why}")
            continue
        lines.append(f"{backend}: {len(rows)} best feasible layout(s), predicted")
        lines.append(f"  {'#':>2} {'tok/s/GPU':>9} {'low-high':>13} {'TFLOPS':>6} {'MFU':>6} {'memory GiB':>11} "
                     f"{'bubble':>6} {'MoE comm':>8} {'exposed':>7}  layout / overrides")
        lines.append(f"  {'':>2} {'':>9} {'':>13} {'':>6} {'':>6} {'':>11} {'of step':>6} {'of step':>8} {'of it':>7}")
        for i, row in enumerate(rows, 1):
            p, b = row.prediction, row.bounds
            lo, _, hi = row.span
            meets = "~" if planner.overlaps_best(row, rows[0]) else " "
            lines.append(f"  {i:>2} {p.tokens_per_s_per_gpu:>9,.0f} {f'{lo:,.0f}-{hi:,.0f}':>12}{meets} "
                         f"{p.tflops_per_gpu:>6,.0f} {p.mfu:>5.1f}% "
                         f"{row.memory_gib:>5.0f} / {row.memory_limit_gib:<4.0f} {b['bubble']:>6.0%} "
                         f"{b['exposed comm']:>8.0%} {p.moe_exposed_share:>7.0%}  {describe(row)}")
            lines.append(" " * 80 + " ".join(row.overrides))  # under the layout column
        if any(planner.overlaps_best(row, rows[0]) for row in rows):
            lines.append("  ~: its range meets #1's; the model cannot tell the two apart")
    lines.append("low-high: every unmeasured input at its pessimistic, then its optimistic end (network efficiency, "
                 "B200 share of peak, routing imbalance, GPU idle, host syncs; results/scale_model.md); step time, TFLOPS "
                 "and MFU move with tok/s")
    return lines


def explain(r: recipe.Recipe, req: planner.Request, cal) -> list[str]:
    """The recipe's own layout and backend against Megatron-Bridge on the same 256 B200, on one
    flop count (Megatron's: attention halved for the causal mask), term by term."""
    ref = planner.MEGATRON_BRIDGE_B200
    w = req.base
    mc = r.config.moe_comm
    cluster = scale_model.cluster_for(req.gpu, req.nodes, req.gpus_per_node, cal)
    rng = scale_model.predict_range(mc.backend, w, cluster, cal, mc.dispatch_dtype)
    p = rng.central
    flops = planner.causal_flops_per_token(w.args, w.seq_len)
    ours = p.tokens_per_s_per_gpu * flops / 1e12
    theirs = ref.tokens_per_s_per_gpu * flops / 1e12
    lo, _, hi = rng.span()
    lines = [f"{r.path} as it stands ({scale_model.backend_class(mc.backend).label(mc.dispatch_dtype)}): "
             f"{p.tokens_per_s_per_gpu:,.0f} tok/s/GPU predicted ({lo:,.0f}-{hi:,.0f}) against {ref.name}'s "
             f"{ref.tokens_per_s_per_gpu:,.0f} ({ref.layout}; {ref.source}). On Megatron's flop count "
             f"({flops / 1e9:.1f} GFLOP/token at seq {w.seq_len}: attention halved for the causal mask; TorchTitan's "
             f"MFU counts the whole matrix, {p.mfu * p.peak_tflops / 100 / p.tokens_per_s_per_gpu * 1e3:.1f}): "
             f"{ours:,.0f} against {theirs:,.0f} TFLOPS/GPU ({ref.name} publishes {ref.tflops_per_gpu:.0f}, counting "
             "its multi-token-prediction layer). Term by term, each term's Shapley share (its cost averaged over "
             "every order of adding the terms, so the order below does not matter):"]
    for term, cost in planner.shortfall(p, flops, ref.tokens_per_s_per_gpu):
        lines.append(f"  {cost:>+8,.0f} TFLOPS  {term}")
    lines.append(f"  (= {theirs - ours:+,.0f})")
    lines.append(f"What differs from {ref.name}'s run: " + "; ".join(planner.differences(w, ref)) + ".")
    return lines


def main(args: argparse.Namespace) -> int:
    overrides = recipe.split_cli_overrides(args, _add_flags)
    try:  # what the flags say alone, before the recipe (and TorchTitan) load
        planner.parse_keep(args.keep)
        token_span(args.global_tokens)
    except planner.PlanError as e:
        print(f"plan error: {e}", file=sys.stderr)
        return 2
    try:
        r = recipe.load(args.recipe, overrides, device="cuda", gpu=args.gpu or "", check_paths=False)
    except recipe.RecipeError as e:
        return recipe.main_error(e)
    try:
        req = request(r, args.nodes, args.gpus_per_node, args.gpu, args.backend, args.keep, args.global_tokens,
                      args.headroom)
        rows = planner.plan(req, calibration.calibrate(), top=args.top)
    except planner.PlanError as e:
        print(f"plan error: {e}", file=sys.stderr)
        return 2
    n = req.nodes * req.gpus_per_node
    print(f"plan for {r.path} on {req.nodes} x {req.gpus_per_node} {req.gpu} ({n} GPUs); kept: "
          f"{planner.kept_text(req)}; memory limit {(1 - req.headroom):.0%} of the GPU; model predictions "
          "(results/scale_model.md: assumptions and errors)")
    for line in table(rows, req):
        print(line)
    if args.explain:
        print("\n".join(explain(r, req, calibration.calibrate())))
    return 0
