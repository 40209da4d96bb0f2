"""`python -m moe_comm check RECIPE.toml`: validate a recipe without starting anything, then
print its resolved parallel layout, a per-GPU memory estimate (moe_comm.predict.estimate) and, per
backend, the scale model's MoE traffic, comm time and MFU on the recipe's cluster
(moe_comm.predict.scale_model).

A recipe error (a bad field, a layout that cannot work) stops it at once (exit 2). What only
this machine lacks (the tokenizer, the data, a writable dump folder: moe_comm.files) does not:
the whole plan is printed first, then the launch blockers with their fixes, and the exit status
is 1 while any remains. `train` and `submit` refuse the same blockers, and what `train` refuses on
this machine (moe_comm.machine: a GPU recipe without a GPU, a CPU run beyond its memory) is one
of them."""

import argparse

from moe_comm import gpus, recipe
from moe_comm import machine as machine_mod
from moe_comm.backends import backend_class, baseline
from moe_comm.layout import flavor_args
from moe_comm.predict import estimate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe TOML file")
    _add_check_flags(parser)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="TorchTitan overrides, e.g. --training.steps 5")


def _add_check_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=None, help="override [cluster] nodes")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="override [cluster] gpus_per_node")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None,
        help="validate for this device (default: what the recipe says, [cluster] request_gpus)",
    )
    parser.add_argument(
        "--skip-files", action="store_true",
        help="do not check the tokenizer, dataset and dump folder here, nor what `train` refuses on this machine "
        "(a recipe for another machine): no launch blockers",
    )
    parser.add_argument(
        "--gpu", default=None, type=gpus.model_name, choices=gpus.MODELS,
        help="the GPU the recipe will run on, for the fit verdict and the SM budget (default: this "
        "machine's, if it has one)",
    )


def _verdict(total_gib: float, r: recipe.Recipe) -> str:
    if r.device == "cpu":
        return "cpu"
    gpu = gpus.lookup(r.plan.gpu)
    if gpu is None:
        return "GPU not known here: pass --gpu for a fit verdict"
    fits = "fits" if total_gib <= 0.9 * gpu.memory_gib else "DOES NOT FIT (keep 10% headroom)"
    return f"{gpu.model} {gpu.memory_gib:.0f} GiB: {fits}"


def report(r: recipe.Recipe) -> str:
    c, lay = r.config, r.layout
    args = flavor_args(c)
    params = estimate.count_params(args)
    t = c.training
    try:
        mem = machine_mod.memory_estimate(r)
    except ValueError as e:  # a pipeline schedule torch would refuse, or the model does not cover
        mem = None
        memory_line = f"memory/GPU  not estimated: {e}"
    lines = [
        f"recipe      {r.path}",
        f"model       {c.model.name} flavor {c.model.flavor}: {params.total / 1e9:.2f}B params, "
        f"{params.active / 1e9:.2f}B active, {params.flops_per_token(args, t.seq_len) / 1e9:.1f} GFLOP/token "
        f"(seq {t.seq_len})",
        f"layout      world {lay.world} = {lay.nodes} node(s) x {lay.procs_per_node}; "
        f"dp_replicate {lay.dp_replicate}, dp_shard {lay.dp_shard}, cp {lay.cp}, tp {lay.tp}, "
        f"pp {lay.pp}, ep {lay.ep}, etp {lay.etp} (efsdp {lay.efsdp})",
        f"backend     {c.moe_comm.backend} (num_sms {c.moe_comm.num_sms}) on {r.device}",
        f"batch       local {t.local_batch_size} x seq {t.seq_len}, AC {c.activation_checkpoint.mode}, "
        f"converters {c.model.converters or 'none'}",
        memory_line if mem is None else _memory_line(mem, r),
    ]
    known = gpus.lookup(r.plan.gpu)
    gpu = "cpu" if r.device == "cpu" else (known.model if known else "")
    lines += _scale_model_lines(r, gpu)
    lines += _nvshmem_buffer_lines(r, args)
    lines += [f"note        {note}" for note in r.notes]
    return "\n".join(lines)


def _memory_line(mem: estimate.MemoryEstimate, r: recipe.Recipe) -> str:
    G = estimate.GiB
    kept = (f" + what the recompute keeps of dispatch and combine {mem.comm_kept / G:.1f}" if mem.comm_kept else "")
    if mem.pipelined:
        held = (f"unsharded stage params {mem.fsdp_working_set / G:.1f} + their fp32 gradients "
                f"{mem.grad_reduce / G:.1f} + ")
        ends = (f"activations {mem.activations / G:.1f} ({mem.microbatches_in_flight:g} microbatches in flight, "
                f"{mem.stages_per_rank} stage(s) per rank){kept} + logits {mem.logits / G:.1f}"
                if mem.peak_at == "end of forward" else f"sharded gradients {mem.gradients / G:.1f}")
    elif not estimate.fsdp_applied(r.layout):  # one GPU: autocast, no fully_shard
        held = (f"autocast's bf16 weight copies {mem.weight_copies / G:.1f} + "
                if mem.peak_at == "end of forward" else "")
        ends = (f"activations {mem.activations / G:.1f}{kept} + logits {mem.logits / G:.1f}"
                if mem.peak_at == "end of forward" else f"fp32 gradients {mem.gradients / G:.1f}")
        ends += " (no fully_shard at this layout)"
    else:
        held = f"FSDP working set {mem.fsdp_working_set / G:.1f} + "
        ends = (f"activations {mem.activations / G:.1f}{kept} + logits {mem.logits / G:.1f}"
                if mem.peak_at == "end of forward" else
                f"gradients {mem.gradients / G:.1f} + gradient reduce {mem.grad_reduce / G:.1f}")
    at = "with the most microbatches in flight" if mem.pipelined and mem.peak_at == "end of forward" else mem.peak_at
    where = at + (", busiest pipeline rank" if mem.pipelined else "")
    graphs = f" + the MoE calls' CUDA graph pools {mem.call_graphs / G:.1f}" if mem.call_graphs else ""
    if mem.fp8_weights:
        graphs += f" + the FP8 experts' e4m3 weights kept over the step {mem.fp8_weights / G:.1f}"
    elif mem.fp8_forward_weights and mem.peak_at == "end of forward":
        graphs += f" + the FP8 experts' e4m3 weights saved for the backward {mem.fp8_forward_weights / G:.1f}"
    return (f"memory/GPU  {mem.total / G:.1f} GiB in use at its peak ({where}): "
            f"params + AdamW {mem.params_and_optimizer / G:.1f} (12 B/param sharded) + {held}{ends}{graphs}"
            f"; reserved by the allocator ~{mem.reserved / G:.1f}; {_verdict(mem.total / G, r)}")


def _nvshmem_buffer_lines(r: recipe.Recipe, args) -> list[str]:
    """The NVSHMEM symmetric buffers of a backend that holds them, sized from the recipe as its
    runtime will size them."""
    from moe_comm.kernels import capacity

    c = r.config
    if not backend_class(c.moe_comm.backend).symmetric_heap:
        return []
    from moe_comm import fp8_experts
    from moe_comm.predict.routing_plan import GROUPED_GEMM_ALIGNMENT
    from moe_comm.predict.scale_model import workload_from_recipe

    mc, t, lay = c.moe_comm, c.training, r.layout
    w = workload_from_recipe(r)  # tokens per MoE call and ranks per (virtual) node, as the model counts them
    per_node = w.ranks_per_node
    tokens = mc.max_tokens_per_rank or w.tokens_per_call
    converters = c.model.converters
    align = GROUPED_GEMM_ALIGNMENT["mxfp8" if "quantize.grouped_mm.mx" in converters
                                   else "fp8" if "quantize.grouped_mm.float8" in converters else "bf16"]
    m = args.moe_args
    row = args.dim * (4 if t.mixed_precision_param == "float32" else 2)
    s = capacity.buffer_sizes(tokens, m.num_experts, m.top_k, row, lay.ep, per_node, mc.recv_capacity_factor)
    rows = fp8_experts.expert_rows(tokens, m.num_experts, m.top_k, lay.ep, mc.recv_capacity_factor, align,
                                   mc.expert_dtype)
    return [
        f"{c.moe_comm.backend:<11} {s.nodes} node(s) x {per_node} per EP group, {tokens} tokens per call; buffers per rank "
        f"(recv_capacity_factor {mc.recv_capacity_factor:g}): {per_node} x {s.fwd_slots:,} recv slots, "
        f"{s.net_slots:,} net slots, {s.send_slots:,} send slots, {rows:,} expert rows; "
        f"symmetric heap ~{s.symmetric_bytes() / estimate.GiB:.1f} GiB",
    ]


def _scale_model_lines(r: recipe.Recipe, gpu: str) -> list[str]:
    """Per backend: the hierarchy, rows and bytes per phase per step, comm time, step, TFLOPS
    and MFU from moe_comm.predict.scale_model on this recipe's cluster, the pipeline as the
    schedule model sees it, the backend it expects to win, and the plan's best layout for the
    recipe's backend when it is predicted more than 10% faster."""
    from moe_comm.predict import calibration, scale_model

    if gpu == "cpu":
        return ["MoE comm    CPU recipe: the scale model prices GPU clusters (pass --gpu H200/H100/B200)"]
    if not gpu:
        return ["MoE comm    GPU not known here: set [cluster] gpu or pass --gpu for the scale model's predictions"]
    try:
        cal = calibration.calibrate()
        w = scale_model.workload_from_recipe(r)
        cluster = scale_model.cluster_for(gpu, r.layout.nodes, r.layout.procs_per_node, cal)
        ranges = {c.label: scale_model.predict_range(c.backend, w, cluster, cal, c.dispatch_dtype)
                  for c in scale_model.choices()}
        preds = {label: rng.central for label, rng in ranges.items()}
    except (OSError, KeyError, ValueError) as e:
        return [f"MoE comm    scale model unavailable ({type(e).__name__}: {e}); results/model_inputs holds its inputs"]
    first = next(iter(preds.values()))
    st = first.comm.stats
    ours = _model_backend(r)
    calls = first.moe_calls_per_step
    pipe = first.pipeline
    lines = [] if r.layout.ep > 1 else [
        f"MoE comm    expert_parallel_degree 1: every expert on each rank, nothing crosses a link; the "
        f"{r.config.moe_comm.backend} backend still lays the rows out expert-major and back (its dispatch "
        "and combine), which the step line times and the scale model prices below"]
    lines += [
        f"MoE comm    EP {r.layout.ep} over {w.ep_nodes} node(s) x {w.ranks_per_node} rank(s); routing "
        f"{w.routing}: {st.nodes_hit_per_token:.2f} nodes and {st.ranks_hit_per_token:.2f} ranks per token "
        f"(per-node dedup {st.node_dedup:.2f}x, per-rank {st.rank_dedup:.2f}x); {w.tokens_per_call} tokens per "
        f"MoE call, {calls:g} MoE layer-microbatches per step on the busiest rank, {_transfers_text(w)}; "
        f"overlap {w.overlap}",
    ]
    if r.layout.pp > 1:
        lines.append(
            f"pipeline    PP {r.layout.pp} {pipe.name}, {pipe.v} stage(s) per rank, {pipe.microbatches} microbatches; "
            f"up to {pipe.peak_chunks / pipe.v:g} microbatches in flight on a rank; PP sends "
            f"{2 * pipe.sends_per_microbatch * pipe.microbatches * w.tokens_per_call * w.args.dim * 2 / 1e9:.1f} GB "
            "per rank and step (activations and gradients); bubble "
            f"{preds[ours].terms_ms['pp bubble'] / preds[ours].step_ms:.0%} of the step ({ours}; "
            "moe_comm.predict.schedule)")
    lines += [
        f"scale model {gpu}, {cluster.nodes} x {cluster.gpus_per_node}; NVLink {cluster.nvlink_copy_gbps:.0f} GB/s, "
        f"network {cluster.network_gbps:.0f} GB/s per GPU (predictions; sources and errors: results/scale_model.md); "
        "per rank and step:",
        f"  {'backend':<13} {'network rows':>13} {'NVLink rows':>13} {'network GB':>11} {'NVLink GB':>10} "
        f"{'comm s':>8} {'exposed s':>10} {'step s':>8} {'tok/s/GPU':>10} {'low-high':>13} {'TFLOPS':>7} {'MFU':>6}",
    ]
    for choice in scale_model.choices():
        name, p = choice.label, preds[choice.label]
        lo, _, hi = ranges[name].span()
        mark = "  <- this recipe" if name == ours else ""
        if not scale_model.runnable(choice.backend, w, choice.dispatch_dtype):
            mark += f"  ({scale_model.refusal(choice.backend, w, choice.dispatch_dtype)})"
        lines.append(
            f"  {name:<13} {p.per_step('network_rows'):>13,.0f} {p.per_step('nvlink_rows'):>13,.0f} "
            f"{p.per_step('network_bytes') / 1e9:>11,.1f} {p.per_step('nvlink_bytes') / 1e9:>10,.1f} "
            f"{p.moe_comm_ms / 1e3:>8.2f} {p.comm_exposed_ms / 1e3:>10.2f} {p.step_ms / 1e3:>8.2f} "
            f"{p.tokens_per_s_per_gpu:>10,.0f} {f'{lo:,.0f}-{hi:,.0f}':>13} {p.tflops_per_gpu:>7,.0f} "
            f"{p.mfu:>5.1f}%{mark}"
        )
    lines.append("  low-high: every unmeasured input at its pessimistic, then its optimistic end (network efficiency, "
                 "B200 share of peak, routing imbalance, GPU idle, host syncs; results/scale_model.md); step time, TFLOPS "
                 "and MFU move with tok/s")
    ok = [c.label for c in scale_model.choices() if scale_model.runnable(c.backend, w, c.dispatch_dtype)]
    best = max(ok, key=lambda b: preds[b].tokens_per_s_per_gpu)
    base = baseline().label()
    lines.append(
        f"  expected fastest on this cluster: {best} ({preds[best].tokens_per_s_per_gpu:,.0f} tok/s/GPU, "
        f"{preds[best].tokens_per_s_per_gpu / preds[base].tokens_per_s_per_gpu:.2f}x {base})"
        + ("" if best == ours else f"; this recipe runs {ours}")
        + "".join(f"; its range meets {b}'s" for b in ok if b != best and ranges[b].overlaps(ranges[best]))
    )
    lines += _plan_lines(r, gpu, preds[ours], ours, cal)
    return lines


def _transfers_text(w) -> str:
    """How many transfers a MoE layer-microbatch makes, and what the AC recompute does with them."""
    if w.comm_recomputed:
        return "6 transfers each (TorchTitan's full AC re-runs the forward ones)"
    if w.ac_mode != "none":
        return ("4 transfers each (the AC recompute replays what dispatch and combine returned: no transfer, "
                "their outputs kept, in the memory line)")
    return "4 transfers each"


def _model_backend(r: recipe.Recipe) -> str:
    mc = r.config.moe_comm
    return backend_class(mc.backend).label(mc.dispatch_dtype)


PLAN_MARGIN = 1.10  # name the plan's best layout when it is predicted this much faster


def _plan_lines(r: recipe.Recipe, gpu: str, ours_pred, ours: str, cal) -> list[str]:
    """The plan's best layout for this recipe's backend, cluster, EP degree and global batch,
    when it is predicted more than 10% faster than the recipe."""
    from moe_comm import plan as plan_verb
    from moe_comm.predict import plan as planner

    lay, t = r.layout, r.config.training
    tokens = float(t.local_batch_size * t.seq_len * lay.dp_shard * lay.dp_replicate)
    try:
        req = plan_verb.request(r, gpu=gpu, backends=[ours], keep=[f"ep={r.layout.ep}"], global_tokens=(tokens, tokens))
        rows = planner.plan(req, cal, top=1)[ours]
    except planner.PlanError as e:
        return [f"plan        no layout to compare ({e})"]
    if not rows or rows[0].tokens_per_s_per_gpu <= PLAN_MARGIN * ours_pred.tokens_per_s_per_gpu:
        return []
    row = rows[0]
    gain = row.tokens_per_s_per_gpu / ours_pred.tokens_per_s_per_gpu - 1
    return [f"plan        predicted {gain:.0%} faster on this cluster with {ours}, EP {r.layout.ep} and the "
            f"global batch kept: "
            f"{row.tokens_per_s_per_gpu:,.0f} tok/s/GPU, {row.memory_gib:.0f} GiB ({plan_verb.describe(row)}): "
            f"{' '.join(row.overrides)}  (python -m moe_comm plan {r.path} for the table)"]


def main(args: argparse.Namespace) -> int:
    overrides = recipe.split_cli_overrides(args, _add_check_flags)
    machine = gpus.this_machine()
    try:
        r = recipe.load(
            args.recipe, overrides, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
            device=args.device, gpu=args.gpu or (machine[0] if machine else ""),
            check_paths=not args.skip_files, allow_blockers=True,
        )
    except recipe.RecipeError as e:
        return recipe.main_error(e)
    if not args.skip_files:  # what `train` refuses on this machine, in its words (moe_comm.machine)
        refused = machine_mod.refusal(args.recipe, overrides, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node)
        r.blockers += [refused] if refused else []
    print(report(r))
    print("\n".join(launch_lines(r)))
    return 1 if r.blockers else 0


def launch_lines(r: recipe.Recipe) -> list[str]:
    """After the plan: what runs but likely not as meant, then what `train` and `submit` refuse
    until it is fixed (exit status 1 while any remains)."""
    lines = [f"warning     {w}" for w in r.warnings]
    if r.blockers:
        lines.append(f"launch blockers ({len(r.blockers)}): `train` and `submit` refuse this recipe here until "
                     "each is fixed (or pass --skip-files to check a recipe for another machine):")
        lines += [f"  - {b}" for b in r.blockers]
    else:
        lines.append("ready       nothing blocks a launch from this machine")
    return lines
