"""`python -m moe_comm check RECIPE.toml`: validate a recipe without starting anything, then
print its resolved parallel layout, a per-GPU memory estimate and the per-step MoE
dispatch/combine volume (how each is computed: moe_comm.estimate)."""

import argparse

from moe_comm import estimate, gpus, recipe


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
        help="do not require the tokenizer/dataset paths to exist here (checking a cluster recipe elsewhere)",
    )
    parser.add_argument(
        "--gpu", default=None, choices=gpus.MODELS,
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
    args = recipe.flavor_args(c)
    params = estimate.count_params(args)
    t = c.training
    mem = estimate.memory_per_gpu(
        args, lay, t.local_batch_size, t.seq_len, c.activation_checkpoint.mode,
        microbatch=c.parallelism.pipeline_parallel_microbatch_size,
    )
    vol = estimate.comm_volume(args, lay, t.local_batch_size, t.seq_len)
    G = estimate.GiB
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
        f"memory/GPU  {mem.total / G:.1f} GiB = model states {mem.model_states / G:.1f} (16 B/param sharded) "
        f"+ FSDP working set {mem.fsdp_working_set / G:.1f} + activations {mem.activations / G:.1f} "
        f"+ logits {mem.logits / G:.1f}; {_verdict(mem.total / G, r)}",
        f"MoE comm    per rank per MoE layer: {vol.rows_per_layer} rows dispatched "
        f"({vol.remote_fraction:.0%} remote; {vol.dedup_rows_per_layer:.0f} remote rows with per-rank dedup); "
        f"per step (fwd+bwd, dispatch+combine, bf16, this rank's MoE layers): "
        f"{vol.bytes_per_step / G:.2f} GiB remote",
    ]
    lines += [f"note        {note}" for note in r.notes]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    overrides = recipe.split_cli_overrides(args, _add_check_flags)
    machine = gpus.this_machine()
    try:
        r = recipe.load(
            args.recipe, overrides, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
            device=args.device, gpu=args.gpu or (machine[0] if machine else ""),
            check_paths=not args.skip_files,
        )
    except recipe.RecipeError as e:
        return recipe.main_error(e)
    print(report(r))
    return 0
