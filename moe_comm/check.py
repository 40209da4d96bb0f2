"""`python -m moe_comm check RECIPE.toml`: validate a recipe without starting anything, then
print its resolved parallel layout, a per-GPU memory estimate and the per-step MoE
dispatch/combine volume (how each is computed: moe_comm.estimate)."""

import argparse

from moe_comm import estimate, recipe

# Usable memory per GPU for the verdict line (what the device reports, GiB).
GPU_MEMORY_GIB = {"H200": 139.8, "H100": 79.1, "B200": 178.4, "cpu": float("inf")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe TOML file")
    _add_check_flags(parser)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="TorchTitan overrides, e.g. --training.steps 5")


def _add_check_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=None, help="override [cluster] nodes")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="override [cluster] gpus_per_node")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None,
        help="validate for this device (default: cuda if this machine has GPUs, else cpu; "
        "GPU recipes are checked for cuda)",
    )
    parser.add_argument(
        "--skip-files", action="store_true",
        help="do not require the tokenizer/dataset paths to exist here (checking a cluster recipe elsewhere)",
    )
    parser.add_argument("--gpu", default=None, choices=sorted(GPU_MEMORY_GIB), help="GPU model for the fit verdict")


def guess_device(path: str) -> str:
    """GPU recipes are checked as GPU recipes even on a CPU machine: the name says which."""
    return "cpu" if "cpu" in path.rsplit("/", 1)[-1] else "cuda"


def guess_gpu(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    for gpu in ("b200", "h200", "h100"):
        if gpu in name:
            return gpu.upper()
    return "cpu" if "cpu" in name else "H200"


def report(r: recipe.Recipe, gpu: str) -> str:
    c, lay = r.config, r.layout
    args = recipe._flavor_args(c)
    params = estimate.count_params(args)
    t = c.training
    mem = estimate.memory_per_gpu(
        args, lay, t.local_batch_size, t.seq_len, c.activation_checkpoint.mode,
        microbatch=c.parallelism.pipeline_parallel_microbatch_size,
    )
    vol = estimate.comm_volume(args, lay, t.local_batch_size, t.seq_len)
    G = estimate.GiB
    cap = GPU_MEMORY_GIB[gpu]
    verdict = "fits" if mem.total / G <= 0.9 * cap else "DOES NOT FIT (keep 10% headroom)"
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
        f"+ logits {mem.logits / G:.1f}; {gpu} {'' if cap == float('inf') else f'{cap:.0f} GiB: '}{verdict}",
        f"MoE comm    per rank per MoE layer: {vol.rows_per_layer} rows dispatched "
        f"({vol.remote_fraction:.0%} remote; {vol.dedup_rows_per_layer:.0f} remote rows with per-rank dedup); "
        f"per step (fwd+bwd, dispatch+combine, bf16, this rank's MoE layers): "
        f"{vol.bytes_per_step / G:.2f} GiB remote",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    overrides = recipe.split_cli_overrides(args, _add_check_flags)
    device = args.device or guess_device(args.recipe)
    try:
        r = recipe.load(
            args.recipe, overrides, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
            device=device, check_paths=not args.skip_files,
        )
    except recipe.RecipeError as e:
        return recipe.main_error(e)
    print(report(r, args.gpu or guess_gpu(args.recipe)))
    return 0
