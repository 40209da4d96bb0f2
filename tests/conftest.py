"""Shared CPU training runs for the whole suite.

A torchrun start costs 15-30 s on a 2-core machine (imports, model set-up, gloo, TorchTitan's
2 s sleep at the end) before its first step, and a run leaves a core idle for seconds (the
launcher's checks, that sleep). So the runs that test files read are listed once, in
SHARED_RUNS, and made in the background from the start of the session, two at a time, while
the tests that need none run; a test that needs a run of its own says why in its docstring.

- `train(dump, *overrides)`: `python -m moe_comm train recipes/debug_cpu.toml` into `dump`, as
  a user runs it from the repository root; the result has `.console` (stdout + stderr without
  colour codes) and `.dump`. `forked_train` runs the same training in ranks forked from
  tests/ranks.py's fork server, without the launcher and torchrun (FORKED_RUNS: the shared runs
  whose tests read only what the ranks wrote).
- `shared_run(name)` (a fixture returning a function): the finished run `name` of SHARED_RUNS,
  waiting for it if it is still training. `default_run` is shared_run("default"), the README's
  main job exactly as a user runs it. Read them, never train into their folders again: copy one
  first (`shutil.copytree(run.dump, ...)`) to resume or extend it.
A session that collects no test using them starts none of them.
- `background` (a module fixture): what the module's own `in_background(shared_run, folder,
  nice)` returned (`nice`: the niceness its processes take). A test module whose set-up waits on
  processes (Slurm jobs, long trainings it drives) defines that function; the session starts it at
  once in a background thread, so its waits overlap the tests that run meanwhile instead of
  leaving a core idle. Its result may have a `close()`, called at the end of the session.

- `csrc_build` (a fixture): the CI build of csrc/ (`python -m moe_comm build --compile-only` for
  sm_90 and sm_100, about 40 CPU-seconds), started in the background at the same moment, at a
  lower priority, so it fills the cores the trainings leave idle; the tests that read it run
  last. A passed build is kept in the build cache under its key (sources, build flags, torch,
  nvcc, NVSHMEM), so the same tree is compiled once per machine.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/debug_cpu.toml"
NO_WANDB = ("--metrics.no-enable_wandb",)
TITAN = ("--model.name", "deepseek_v3_titan")
# bf16 matmuls are ~4x slower than fp32 on this CPU: a shorter run (seq 64, 2 steps with one
# optimizer update in between) keeps the pair to about a minute of CPU.
BF16 = ("--training.mixed_precision_param", "bfloat16", "--training.seq_len", "64", "--training.steps", "2")

# {name: overrides of `train`}, in the order they start in. Add a run here, or better reuse one,
# for a new CPU test.
SHARED_RUNS = {
    # 4 steps with a checkpoint every 2: test_train_lifecycle copies it to resume, extend or break
    # it (first: that module's background work waits for it)
    "checkpointed": (*NO_WANDB, "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4"),
    # the README's main job as a user runs it (5 steps, EP 2, W&B offline): test_console,
    # test_wandb_e2e, test_train_equality
    "default": (),
    # pipeline parallelism: 4 ranks, PP 2 x FSDP 2, EP 2 in each stage, every rank's log
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--training.steps", "2",
            "--lr_scheduler.warmup_steps", "1", *NO_WANDB),
    # test_train_equality: TorchTitan's own path and EP 1 against the default run's first 3
    # steps (a 3-step and a 5-step run see the same learning rates up to step 3), and the bf16 pair
    "titan_ep2": (*NO_WANDB, *TITAN, "--training.steps", "3"),
    "ours_ep1": (*NO_WANDB, "--parallelism.expert_parallel_degree", "1", "--training.steps", "3"),
    "ours_ep2_bf16": (*NO_WANDB, *BF16),
    "titan_ep2_bf16": (*NO_WANDB, *TITAN, *BF16),
    # test_train_equality: the batches loaded ahead by a dataloader worker, as a GPU run can load
    # them while the GPU computes (results/h200x1/README.md, fifteenth session), train the same.
    # Launched as a user launches it, not forked: the fork server's ranks start workers by
    # forkserver, which must pickle the dataset, and TorchTitan's merged job config does not pickle
    "ours_ep2_workers": (*NO_WANDB, "--training.steps", "3", "--training.dataloader.num_workers", "1",
                         "--training.dataloader.prefetch_factor", "2"),
    # test_train_equality: the model under TorchTitan's [compile] (model and loss), as the MXFP8
    # recipe runs it, through our MoE path. aot_eager traces and differentiates exactly what
    # inductor would (dynamo, fullgraph, AOT autograd) without generating C++ kernels (inductor
    # took ~35 s of CPU for the same graphs)
    "ours_ep2_compiled": (*NO_WANDB, "--training.steps", "3", "--compile.enable", "--compile.backend", "aot_eager"),
}
# The shared runs whose tests read only what the ranks wrote (losses, metrics, rank logs), with
# their number of ranks: forked from tests/ranks.py's fork server (tests/titan_rank.py) instead of
# started by `train` and torchrun, which saves ~10 CPU-seconds of start-up per run and ~7 per rank
# (the launcher's, torchrun's and each rank's imports); the same trainer with the same arguments.
FORKED_RUNS = {"titan_ep2": 2, "ours_ep1": 2, "ours_ep2_bf16": 2, "titan_ep2_bf16": 2, "pp2": 4, "ours_ep2_compiled": 2}
# The background's processes (shared runs, the modules' `in_background` work) run at this nice
# value: the test thread, whose tests run one at a time, keeps a core to itself, and the
# background fills what is left (on 2 cores, with everything at one priority, the background's
# 8-10 processes held the test thread to a fifth of a core, and the session ended with a core idle
# behind it).
BACKGROUND_NICE = 10
# ... except the longest chain of background work, which goes ahead of the rest at this niceness:
# the "checkpointed" run, then test_train_lifecycle's runs copied from it (~170 s of trainings and
# waits one after the other). At BACKGROUND_NICE its launcher waited ~110 s for the cores behind
# the Slurm jobs and the other runs, and the session ended on the chain with the cores idle.
AHEAD = ("checkpointed", "test_train_lifecycle")
AHEAD_NICE = 5


def background_nice(name: str) -> int:
    """The niceness of the shared run or background module `name`."""
    return AHEAD_NICE if name in AHEAD else BACKGROUND_NICE


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the settings a user's shell may carry that change a run's
    output (W&B credentials and modes, thread counts, HF offline mode)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    for var in ("OMP_NUM_THREADS", "HF_DATASETS_OFFLINE"):
        env.pop(var, None)
    env.update(extra)
    return env


def train(dump: Path, *overrides: str, env: dict[str, str] | None = None, timeout: float = 600,
          recipe: str = RECIPE, nice: int = 0) -> subprocess.CompletedProcess:
    niced = ["nice", "-n", str(nice)] if nice else []
    proc = subprocess.run([*niced, sys.executable, "-m", "moe_comm", "train", recipe, "--job.dump_folder", str(dump), *overrides],
                          cwd=REPO, env=env or clean_env(WANDB_MODE="offline"), capture_output=True, text=True,
                          timeout=timeout)
    proc.console = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    proc.dump = Path(dump)
    return proc


def forked_train(dump: Path, *overrides: str, world: int = 2, nice: int = 0) -> SimpleNamespace:
    """`train(dump, *overrides)`'s training without the launcher and torchrun: its `world` ranks
    forked from the fork server (tests/titan_rank.py), their output in dump/logs/rank{R}.log. A
    failing rank raises, naming it (tests/ranks.py)."""
    import ranks
    from metrics_fakes import free_port

    argv = ["--job.config_file", RECIPE, "--job.dump_folder", str(dump), *overrides]
    ranks.spawn("titan_rank:run_rank", args=(world, free_port(), argv, str(Path(dump) / "logs"), nice), nprocs=world)
    return SimpleNamespace(returncode=0, console="", dump=Path(dump))


class _SharedRuns:
    """SHARED_RUNS training in the background, two at a time, into one temporary folder, and the
    collected modules' `in_background` functions beside them."""

    def __init__(self, runs: bool, modules: list):
        self.folder = Path(tempfile.mkdtemp(prefix="moe_comm-shared-runs-"))
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shared-run")
        # the modules' functions start at once, each in a thread of its own: they mostly wait
        # (on Slurm, on a shared run, on their processes' steps)
        self.module_pool = ThreadPoolExecutor(max_workers=max(4, len(modules)), thread_name_prefix="background")
        self.lock = threading.Lock()
        self.futures: dict[str, Future] = {
            name: self.pool.submit(self._train, name) for name in (SHARED_RUNS if runs else ())}
        self.modules: dict[str, Future] = {}
        for module in modules:
            self.start_module(module)

    def _train(self, name: str):
        overrides = SHARED_RUNS[name]
        if name in FORKED_RUNS:
            return forked_train(self.folder / name, *overrides, world=FORKED_RUNS[name], nice=background_nice(name))
        return train(self.folder / name, *overrides, nice=background_nice(name))

    def start_module(self, module) -> Future:
        with self.lock:
            if module.__name__ not in self.modules:
                self.modules[module.__name__] = self.module_pool.submit(
                    module.in_background, self.get, self.folder / module.__name__, background_nice(module.__name__))
            return self.modules[module.__name__]

    def get(self, name: str) -> subprocess.CompletedProcess:
        """The finished shared run `name`, started now if the session had not started it (its
        workers only train, so a run queued behind a module's waiting thread never starves)."""
        with self.lock:
            if name not in self.futures:
                self.futures[name] = self.pool.submit(self._train, name)
            future = self.futures[name]
        proc = future.result()
        assert proc.returncode == 0, f"shared run {name!r} failed:\n{proc.console[-6000:]}"
        return proc

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.module_pool.shutdown(wait=True, cancel_futures=True)
        for future in self.modules.values():
            if not future.cancelled() and future.exception() is None and hasattr(future.result(), "close"):
                future.result().close()
        shutil.rmtree(self.folder, ignore_errors=True)


_shared: _SharedRuns | None = None


class _CsrcBuild:
    """`python -m moe_comm build --compile-only` in the background, kept on success in the build
    cache under the key of everything it depends on (moe_comm.kernels.build.cache_key): a tree
    whose check already passed on this machine is not compiled again."""

    ARCHS = ("90", "100")

    def __init__(self):
        from moe_comm.kernels.build import cache_key, default_cache_dir

        self.kept = default_cache_dir() / f"{cache_key(self.ARCHS)}-check"
        self.out = self.proc = None
        if (self.kept / "obj" / "dlink.o").is_file():
            return
        self.out = Path(tempfile.mkdtemp(prefix="moe_comm-csrc-build-"))
        self.log = self.out / "build.log"
        cmd = ["nice", "-n", "10", sys.executable, "-m", "moe_comm", "build", "--compile-only",
               "--arch", *self.ARCHS, "--out", str(self.out / "build")]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def result(self, timeout: float = 1800) -> Path:
        """The build folder once the build has ended; its output names what failed."""
        if self.proc is not None:
            rc = self.proc.wait(timeout=timeout)
            assert rc == 0, f"the csrc build failed ({rc}):\n{self.log.read_text()[-6000:]}"
            self.kept.parent.mkdir(parents=True, exist_ok=True)
            if not self.kept.exists():
                try:
                    os.replace(self.out / "build", self.kept)
                except OSError:  # another session kept the same tree's build first
                    pass
            self.proc = None
        return self.kept if self.kept.exists() else self.out / "build"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.out is not None:
            shutil.rmtree(self.out, ignore_errors=True)


_csrc: _CsrcBuild | None = None


def pytest_collection_modifyitems(session, config, items):
    """The order: the modules that read nothing from the background, while it trains; then the
    modules that read shared runs or their own background work (whole modules, so that module
    fixtures are set up once); then the tests that wait for the csrc build. So the test thread
    has work while the background runs and finds it done when it reads it."""
    def uses(item, fixture: str) -> bool:
        return fixture in getattr(item, "fixturenames", ())

    readers = {getattr(item, "module", None) for item in items if uses(item, "shared_run") or uses(item, "background")}
    waiting = [item for item in items if uses(item, "csrc_build")]
    rest = [item for item in items if item not in waiting]
    items[:] = ([item for item in rest if getattr(item, "module", None) not in readers]
                + [item for item in rest if getattr(item, "module", None) in readers] + waiting)


def pytest_collection_finish(session):
    """Start SHARED_RUNS, the modules' `in_background` functions and the csrc build as soon as
    the tests are known, if any reads them."""
    global _shared, _csrc
    if session.config.option.collectonly:
        return
    runs = any("shared_run" in getattr(item, "fixturenames", ()) for item in session.items)
    modules = {item.module.__name__: item.module for item in session.items
               if "background" in getattr(item, "fixturenames", ())}
    if runs or modules:
        _shared = _SharedRuns(runs, [modules[name] for name in sorted(modules)])
    if any("csrc_build" in getattr(item, "fixturenames", ()) for item in session.items):
        _csrc = _CsrcBuild()


def pytest_sessionfinish(session):
    if _shared is not None:
        _shared.close()
    if _csrc is not None:
        _csrc.close()


@pytest.fixture(scope="session")
def csrc_build() -> Path:
    """The folder `python -m moe_comm build --compile-only` built csrc/ into (obj/, dlink.o)."""
    global _csrc
    if _csrc is None:
        _csrc = _CsrcBuild()
    return _csrc.result()


@pytest.fixture(scope="session")
def shared_run():
    global _shared
    if _shared is None:  # collected without the hook's knowledge (e.g. a plugin filtered late)
        _shared = _SharedRuns(True, [])
    return _shared.get


@pytest.fixture(scope="module")
def background(request):
    """What this module's `in_background(shared_run, folder, nice)` returned (see the module docstring)."""
    global _shared
    if _shared is None:  # collected without the hook's knowledge
        _shared = _SharedRuns(False, [])
    return _shared.start_module(request.module).result()


@pytest.fixture(scope="session")
def default_run(shared_run) -> subprocess.CompletedProcess:
    """`python -m moe_comm train recipes/debug_cpu.toml` (the README's main job), W&B offline."""
    return shared_run("default")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo group for in-process backend tests (a file store: no port to collide with
    other test sessions), destroyed after the module: a default group left behind fails the next
    module's own init."""
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        store = tmp_path_factory.mktemp("store") / "pg"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    if made:
        dist.destroy_process_group()


@pytest.fixture
def world_of_one():
    """A one-rank gloo group over an in-memory store, for one test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_thread():
    """Torch's intra-op threads crawl when the cores are oversubscribed (a shared CI machine):
    one thread keeps the small in-process models at about a second each."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
