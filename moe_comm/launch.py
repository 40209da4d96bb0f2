"""`python -m moe_comm train RECIPE.toml [TorchTitan overrides]`: validate, then train.

One node (the default):
    python -m moe_comm train recipes/debug_cpu.toml --training.steps 5
runs `torchrun --standalone --nproc_per_node N -m moe_comm.trainer --job.config_file RECIPE
--training.steps 5` (moe_comm.trainer: TorchTitan's trainer, torchtitan.train), where N is the
recipe's [cluster] gpus_per_node (on CPU: the number of processes) unless `--nproc-per-node`
overrides it.

Multi-node contract (the Slurm template calls this once per node through srun):
    python -m moe_comm train RECIPE.toml --nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID \\
        [--nproc-per-node G] [-- TorchTitan overrides]
switches torchrun to c10d rendezvous:
    torchrun --nnodes N --nproc_per_node G --rdzv_backend c10d --rdzv_endpoint HOST:PORT
             --rdzv_id ID -m moe_comm.trainer --job.config_file RECIPE ...
All three of --nnodes/--rdzv-endpoint/--rdzv-id are needed together, and a recipe whose
[cluster] nodes > 1 is refused without them (submit it with `python -m moe_comm submit`).
TorchTitan overrides may follow `--` or be given directly; anything this parser does not know
is passed to TorchTitan. The torchrun command also gets `--local-ranks-filter 0` (see --log-rank).
`--dry-run` prints the torchrun command instead of running it.

Before torchrun starts, on every node:
  - the recipe is validated for the whole world (nnodes x nproc-per-node) on this machine, and a
    CPU run whose memory estimate exceeds this machine's memory is refused (moe_comm.machine);
  - the dump folder is claimed for this run (moe_comm.claim): a folder another run trains in is
    refused, naming it; the nodes of one job share the claim; a stale claim is taken over;
  - the dump folder is claimed for this run's identity (moe_comm.metrics.naming): a folder that
    holds another run (another backend, batch, layout...) is refused, never mixed;
  - with checkpointing on, the checkpoint to resume from is chosen (moe_comm.checkpoints): a
    truncated or model-only newest checkpoint is skipped, saying why, and the last save is a
    full checkpoint unless the recipe sets [checkpoint] last_save_model_only itself, so the next
    run in the folder can always resume. A checkpoint already at [training] steps means nothing
    to do (said, exit 0, no torchrun); resuming under another learning-rate schedule than the
    checkpoint's is a warning (moe_comm.lr_schedule).
While it runs, SIGTERM (Slurm's preemption and time limit), SIGINT (Ctrl-C) and SIGHUP are
passed to torchrun, which stops every rank; ranks also die if torchrun is killed outright. The
console then says so in one line (moe_comm.relay: torchrun's stderr goes to DUMP/logs). After a
failure, torchrun's report is summed up in one line, the footer of another rank is shown when
the shown rank printed none (it was killed), and a rank that stopped answering
(moe_comm.heartbeat) is named.
"""

import argparse
import os
import shlex
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

from moe_comm import checkpoints, claim, heartbeat, lr_schedule, machine, recipe, relay
from moe_comm.metrics import naming

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SHUTDOWN_GRACE_S = 60  # torchrun gives its ranks 30 s after a signal, then SIGKILLs them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe TOML file (recipes/*.toml)")
    _add_launch_flags(parser)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="TorchTitan overrides, e.g. --training.steps 5")


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=None, help="processes per node (default: [cluster] gpus_per_node)")
    parser.add_argument("--nnodes", type=int, default=None, help="nodes in the job (multi-node: with --rdzv-endpoint and --rdzv-id)")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (the first node)")
    parser.add_argument("--rdzv-id", default=None, help="rendezvous id shared by all nodes, e.g. $SLURM_JOB_ID")
    parser.add_argument("--log-rank", default="0", help="ranks whose output torchrun shows (torchrun --local-ranks-filter); 'all' for every rank")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the torchrun command, run nothing")


def torchrun_command(args: argparse.Namespace, r: recipe.Recipe, overrides: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    multi_node = (args.nnodes, args.rdzv_endpoint, args.rdzv_id)
    if any(v is not None for v in multi_node):
        if not all(v is not None for v in multi_node):
            raise recipe.RecipeError(
                "--nnodes, --rdzv-endpoint and --rdzv-id go together (multi-node c10d rendezvous); "
                "give all three or none"
            )
        cmd += [
            "--nnodes", str(args.nnodes),
            "--nproc_per_node", str(r.layout.procs_per_node),
            "--rdzv_backend", "c10d",
            "--rdzv_endpoint", args.rdzv_endpoint,
            "--rdzv_id", str(args.rdzv_id),
        ]
    else:
        cmd += ["--standalone", "--nproc_per_node", str(r.layout.procs_per_node)]
    if args.log_rank != "all":
        cmd += ["--local-ranks-filter", args.log_rank]
    cmd += ["-m", "moe_comm.trainer", "--job.config_file", args.recipe, *overrides]  # TorchTitan's trainer
    return cmd


def _sets(r: recipe.Recipe, section: str, key: str) -> bool:
    """Whether the recipe file or an override sets [section] key itself."""
    spelled = {f"--{section}.{key}", f"--{section}.no-{key}"}
    return key in r.toml.get(section, {}) or any(o in spelled for o in r.overrides)


def checkpoint_overrides(r: recipe.Recipe) -> tuple[list[str], checkpoints.Resume]:
    """(overrides that make the run resumable, where it resumes); see the module doc."""
    ckpt = r.config.checkpoint
    if not ckpt.enable:
        return [], checkpoints.Resume(None, None, [])
    # HF safetensors can only hold the model, so a recipe that asks for them keeps TorchTitan's default.
    keep = _sets(r, "checkpoint", "last_save_model_only") or ckpt.last_save_in_hf
    extra = [] if keep else ["--checkpoint.no-last_save_model_only"]
    resume = checkpoints.resume_step(Path(r.config.job.dump_folder) / ckpt.folder, ckpt.load_step)
    if resume.load_step is not None:
        extra += ["--checkpoint.load_step", str(resume.load_step)]
    return extra, resume


def _report_stopped_ranks(folder: Path) -> None:
    for beat, silent_s in heartbeat.stopped_ranks(heartbeat.read(folder)):
        print(
            f"moe_comm: rank {beat.rank} (pid {beat.pid} on {beat.host}) stopped answering {silent_s:.0f} s "
            "before the other ranks ended: it is the rank that hung. The errors of the other ranks "
            "(timeouts waiting for it in a collective) follow from it, whatever torchrun names as "
            "the root cause above.",
            file=sys.stderr, flush=True,
        )


def run_torchrun(cmd: list[str], env: dict[str, str], beats: Path, held: "claim.Claim | None" = None,
                 logs: Path = Path("logs"), shown: set[int] | None = None) -> int:
    """Run torchrun and wait for it, passing on the signals that should stop the job; the dump
    folder's claim is kept fresh meanwhile, and losing it stops the run like a SIGTERM.
    torchrun's stderr goes to `logs` and, as moe_comm.relay says, to the console; `shown`: the
    ranks torchrun shows here (moe_comm.relay.shown_ranks)."""
    received: list[int] = []
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE,
                            preexec_fn=lambda: heartbeat.die_with_parent(signal.SIGTERM))
    out = relay.Relay(proc.stderr, relay.log_path(logs))

    def forward(signum, frame):
        received.append(signum)
        out.quiet = True  # what torchrun says while it stops the ranks goes to its log only
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def lost(message: str) -> None:
        print(f"moe_comm: {message}", file=sys.stderr, flush=True)
        forward(signal.SIGTERM, None)

    if held is not None:
        held.keep_fresh(lost)
    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    deadline = None
    try:
        while True:
            try:
                rc = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and deadline is None:
                deadline = time.monotonic() + SHUTDOWN_GRACE_S
            if deadline is not None and time.monotonic() > deadline:  # torchrun did not stop its ranks
                print(f"moe_comm: torchrun did not stop {SHUTDOWN_GRACE_S} s after the signal; killing it and its ranks",
                      file=sys.stderr, flush=True)
                for beat in heartbeat.read(beats):
                    try:
                        os.kill(beat.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.kill()
                deadline = float("inf")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        out.join()
    if received:
        name = signal.Signals(received[0]).name
        print(f"moe_comm: stopped by {name}; torchrun and every rank have exited; logs in {logs}",
              file=sys.stderr, flush=True)
        return 128 + received[0]
    if rc != 0:
        for line in (out.summary(), relay.missing_footer(logs, shown, started)):
            if line:
                print(line, file=sys.stderr, flush=True)
        _report_stopped_ranks(beats)
    return rc


def main(args: argparse.Namespace) -> int:
    overrides = recipe.split_cli_overrides(args, _add_launch_flags)
    try:
        r = machine.load_here(args.recipe, overrides, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node)
        if args.nnodes is None and r.layout.nodes > 1:
            raise recipe.RecipeError(
                f"[cluster] nodes = {r.layout.nodes}: this recipe spans several nodes; submit it "
                "with `python -m moe_comm submit`, or run `train` on every node with --nnodes, "
                "--rdzv-endpoint and --rdzv-id"
            )
    except recipe.RecipeError as e:
        return recipe.main_error(e)
    for warning in r.warnings:
        print(f"moe_comm: warning: {warning}", file=sys.stderr, flush=True)
    held = None
    if not args.dry_run:
        held = claim.Claim(r.config.job.dump_folder, claim.me(shlex.join(sys.argv), args.rdzv_id))
        try:
            for message in held.take():
                print(f"moe_comm: {message}", file=sys.stderr, flush=True)
        except recipe.RecipeError as e:
            return recipe.main_error(e)
    try:
        return _launch(args, r, held)
    finally:
        if held is not None:
            held.release()


def _launch(args: argparse.Namespace, r: recipe.Recipe, held: "claim.Claim | None") -> int:
    """Everything after the claim: the run's identity, the checkpoint to resume, torchrun."""
    try:
        identity = naming.run_identity(r.config, r.layout.nodes, r.layout.procs_per_node)
        naming.claim_dump_folder(r.config.job.dump_folder, identity, write=not args.dry_run)
        extra, resume = checkpoint_overrides(r)
        cmd = torchrun_command(args, r, r.overrides + extra)
    except recipe.RecipeError as e:
        return recipe.main_error(e)
    for message in resume.messages:
        print(f"moe_comm: checkpoint: {message}", file=sys.stderr, flush=True)
    dump, steps = Path(r.config.job.dump_folder), r.config.training.steps
    if resume.step is not None and resume.step >= steps:
        print(f"moe_comm: nothing to do: {dump / r.config.checkpoint.folder}/step-{resume.step} is at [training] "
              f"steps = {steps} already. To train on, raise --training.steps (the learning-rate schedule is "
              "then rebuilt for the new length), or give a new --job.dump_folder to start again",
              file=sys.stderr, flush=True)
        return 0
    if resume.step:
        warning = lr_schedule.changed(dump, r.config, resume.step)
        if warning:
            print(f"moe_comm: warning: {warning}", file=sys.stderr, flush=True)
    if r.config.checkpoint.enable and not args.dry_run:
        lr_schedule.record(dump, r.config)

    env = dict(os.environ)
    if r.layout.procs_per_node > 1:  # what torchrun sets anyway, without its 4-line banner
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1" if r.config.training.dataset == "c4_test" else "0")
    print("+ " + shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    beats = heartbeat.make_folder()
    try:
        env[heartbeat.DIR_ENV] = str(beats)
        return run_torchrun(cmd, env, beats, held, logs=dump / "logs",
                            shown=relay.shown_ranks(args.log_rank, args.nnodes))
    finally:
        shutil.rmtree(beats, ignore_errors=True)
