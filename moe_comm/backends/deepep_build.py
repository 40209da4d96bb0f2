"""`python -m moe_comm build-deepep`: build and install DeepEP, pinned to v1.2.1.

TorchTitan 0.2.2's DeepEP path targets DeepEP's V1 `Buffer` API; DeepEP's main branch is V2
(ElasticBuffer on NCCL Gin) and would break it, and the `deep-ep` wheel on PyPI is an unofficial
snapshot without headers that cannot build. So the project builds the tagged source against the
same NVSHMEM wheel its own kernels use (DeepEP's setup.py finds `nvidia.nvshmem` by itself):

    python -m moe_comm build-deepep                    # clone tag v1.2.1, build, pip install
    python -m moe_comm build-deepep --source DIR|TGZ   # a local checkout or `git archive` of it

It builds a wheel (about a minute on 16 cores) and installs it into this Python environment.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEEPEP_REPO = "https://github.com/deepseek-ai/DeepEP"
DEEPEP_TAG = "v1.2.1"
DEEPEP_VERSION = "1.2.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", type=Path, default=None,
                        help=f"DeepEP {DEEPEP_TAG} source: a folder or a .tar.gz of it (default: git clone the tag)")
    parser.add_argument("--arch", nargs="+", default=["9.0"], help="TORCH_CUDA_ARCH_LIST entries, e.g. 9.0 10.0")
    parser.add_argument("--wheel-dir", type=Path, default=None, help="keep the built wheel here")
    parser.add_argument("--no-install", action="store_true", help="build the wheel only")


def _source_tree(source: Path | None, work: Path) -> Path:
    if source is None:
        subprocess.run(["git", "clone", "--depth", "1", "--branch", DEEPEP_TAG, DEEPEP_REPO, str(work / "DeepEP")],
                       check=True)
        return work / "DeepEP"
    if source.is_dir():
        return source
    with tarfile.open(source) as tar:
        tar.extractall(work, filter="data")
    roots = [p for p in work.iterdir() if (p / "setup.py").exists()]
    if len(roots) != 1:
        raise SystemExit(f"{source} does not hold one DeepEP source tree with a setup.py")
    return roots[0]


def _check_version(tree: Path) -> None:
    """Refuse anything but the V1 API TorchTitan 0.2.2 targets."""
    buffer = tree / "deep_ep" / "buffer.py"
    if not buffer.exists() or "def get_dispatch_layout" not in buffer.read_text():
        raise SystemExit(
            f"{tree} is not DeepEP {DEEPEP_TAG}: its deep_ep/buffer.py lacks the V1 Buffer.get_dispatch_layout "
            f"that TorchTitan 0.2.2 calls; use the tag {DEEPEP_TAG} (`git archive {DEEPEP_TAG}`)"
        )


def main(args: argparse.Namespace) -> int:
    try:
        import nvidia.nvshmem  # noqa: F401
    except ImportError:
        print("build-deepep needs the NVSHMEM wheel: pip install 'nvidia-nvshmem-cu13==3.4.5'", file=sys.stderr)
        return 2
    from moe_comm.kernels.build import cuda_home

    cuda = cuda_home()
    with tempfile.TemporaryDirectory(prefix="deepep-") as tmp:
        tree = _source_tree(args.source, Path(tmp))
        _check_version(tree)
        env = dict(os.environ)
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(args.arch)
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
        env["CPATH"] = os.pathsep.join(filter(None, [str(cuda / "include" / "cccl"), env.get("CPATH")]))
        dist = Path(tmp) / "dist"
        subprocess.run([sys.executable, "setup.py", "bdist_wheel", "--dist-dir", str(dist)], cwd=tree, env=env,
                       check=True)
        wheel = next(dist.glob("deep_ep-*.whl"))
        if args.wheel_dir:
            args.wheel_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(wheel, args.wheel_dir)
        if not args.no_install:
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)],
                           check=True)
        print(f"built DeepEP {DEEPEP_VERSION} ({wheel.name}){'' if args.no_install else ' and installed it'}")
    return 0
