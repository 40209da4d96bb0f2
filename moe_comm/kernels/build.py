"""Build the CUDA dispatch/combine extension (csrc/) against the nvidia-nvshmem-cu13 wheel.

torch.utils.cpp_extension's JIT path cannot device-link relocatable objects, which NVSHMEM's
device library needs, so this module runs the steps itself, with torch's own include
paths and ABI flag:
  1. nvcc -rdc=true each .cu (and c++ for the torch op bindings);
  2. nvcc -shared against libnvshmem_device, torch and libnvshmem_host.so.3 (rpath to the wheel);
     nvcc device-links the relocatable objects itself. The compile-only check (CI) runs that
     device link as a step of its own (nvcc -dlink) instead of linking the library.
The library lands in a cache folder keyed by the source hash, GPU architectures, torch version
and nvcc version, so the first use builds it (about a minute) and later uses load it.

Ahead of time (cluster images): `python -m moe_comm build --arch 90 100 [--out DIR]`.
Compile-only check (CI, no GPU, CPU torch): `python -m moe_comm build --compile-only` compiles
every file of csrc/ (subfolders included) against the wheel's and torch's headers, the kernels to
SASS for every architecture asked (from one front-end pass while no file branches on
__CUDA_ARCH__) and the op bindings without code generation, and device-links the kernels; only
the final link needs a CUDA torch. It compiles them as one translation unit per language (a file
that includes every kernel, one that includes every op binding): parsing NVSHMEM's, CCCL's and
torch's headers is most of each file's compile, so the check costs about 40 CPU-seconds instead of
about 165 on a 2-core CI machine. What that leaves to the full build, which compiles each file on
its own: a file that uses what only an earlier file included. Names private to one file
(anonymous namespaces, static functions) must differ across csrc/: a clash fails the check,
naming both places.
"""

import argparse
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[2] / "csrc"
LIBRARY_NAME = "moe_comm_cuda.so"
DEFAULT_ARCHS = ("90", "100")  # H100/H200, B200


def nvshmem_root() -> Path:
    spec = importlib.util.find_spec("nvidia.nvshmem")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the NVSHMEM wheel is missing: pip install 'nvidia-nvshmem-cu13==3.4.5' "
            "(or this project's [gpu] extra)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def cuda_home() -> Path:
    from torch.utils.cpp_extension import CUDA_HOME

    home = CUDA_HOME or "/usr/local/cuda"
    if not (Path(home) / "bin" / "nvcc").exists():
        raise RuntimeError(f"nvcc not found under {home}; set CUDA_HOME to a CUDA 13 toolkit")
    return Path(home)


def current_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def _sources() -> tuple[list[Path], list[Path]]:
    """Every kernel (.cu) and host (.cpp) file of the tree, subfolders included."""
    cuda = sorted(CSRC.rglob("*.cu"))
    host = sorted(CSRC.rglob("*.cpp"))
    return cuda, host


def _object_name(src: Path) -> str:
    """comm/dispatch.cu -> comm__dispatch.o: one object per source, unique across folders."""
    return "__".join(src.relative_to(CSRC).with_suffix(".o").parts)


def _one_unit(path: Path, sources: list[Path]) -> Path:
    """A file that includes every one of `sources`: the compile-only check's translation unit."""
    path.write_text("".join(f'#include "{src}"\n' for src in sources))
    return path


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"build step failed:\n  {' '.join(cmd)}\n{result.stdout}{result.stderr}")


def _run_all(commands: list[list[str]]) -> None:
    """Compile steps side by side (MAX_JOBS of them, default: the CPUs); the first failure raises."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for future in [pool.submit(_run, cmd) for cmd in commands]:
            future.result()


def _gencode(archs: tuple[str, ...]) -> list[str]:
    return [flag for arch in archs for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]


def _check_gencode(archs: tuple[str, ...]) -> list[str]:
    """The compile-only check's targets: SASS for every architecture, from one front-end pass.

    cicc (parsing NVSHMEM's and CCCL's device headers) is ~80% of a kernel file's compile, once
    per virtual architecture. While no file of csrc/ branches on __CUDA_ARCH__, every
    architecture's PTX is the same program, so the check generates the lowest one's and has
    ptxas assemble it for each target: every architecture's SASS (register caps, instruction
    availability) is still checked. A file that branches on __CUDA_ARCH__ makes the check
    compile each architecture on its own, as a real build always does.
    """
    files = [*CSRC.rglob("*.cu"), *CSRC.rglob("*.cuh"), *CSRC.rglob("*.h")]
    if len(archs) == 1 or any("__CUDA_ARCH__" in path.read_text() for path in files):
        return _gencode(archs)
    lowest = min(archs, key=int)
    return ["-gencode", f"arch=compute_{lowest},code=[{','.join(f'sm_{arch}' for arch in archs)}]"]


def cache_key(archs: tuple[str, ...]) -> str:
    """What a build depends on: every source and header of csrc/, this file (its flags), the
    architectures, torch, nvcc and the NVSHMEM wheel."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    cuda, host = _sources()
    headers = list(CSRC.rglob("*.h")) + list(CSRC.rglob("*.cuh"))
    for path in sorted(cuda + host + headers):
        h.update(str(path.relative_to(CSRC)).encode())
        h.update(path.read_bytes())
    nvcc_version = subprocess.run(
        [str(cuda_home() / "bin" / "nvcc"), "--version"], capture_output=True, text=True
    ).stdout
    h.update(f"{archs}|{torch.__version__}|{nvcc_version}|{nvshmem_root()}".encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    root = os.environ.get("MOE_COMM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "moe_comm"))
    return Path(root)


def build(archs: tuple[str, ...], out_dir: Path, compile_only: bool = False, verbose: bool = False) -> Path:
    """Compile csrc/ into out_dir; returns the library path (or the device-link object)."""
    from torch.utils import cpp_extension

    nv = nvshmem_root()
    cuda = cuda_home()
    nvcc = str(cuda / "bin" / "nvcc")
    out_dir.mkdir(parents=True, exist_ok=True)
    build_dir = out_dir / "obj"
    build_dir.mkdir(exist_ok=True)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{CSRC}", f"-I{nv / 'include'}", f"-I{cuda / 'include'}", f"-I{cuda / 'include' / 'cccl'}"]
    torch_includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    gencode = _check_gencode(archs) if compile_only else _gencode(archs)

    cuda_sources, host_sources = _sources()
    nvcc_flags = ["-rdc=true", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", abi, *gencode]
    if verbose:
        nvcc_flags.insert(0, "-Xptxas=-v")
    cxx = os.environ.get("CXX", "c++")
    host_includes = list(includes) + torch_includes
    if torch.version.cuda is None:
        if not compile_only:
            raise RuntimeError("building the CUDA library needs a CUDA build of torch (this one is CPU-only)")
        # A CPU torch ships c10/cuda's headers without the one its CMake generates; the
        # compile-only check supplies it, so the op bodies are checked against the same headers.
        shim = build_dir / "shim" / "c10" / "cuda" / "impl"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        host_includes.append(f"-I{build_dir / 'shim'}")
    if compile_only:
        # One translation unit per language (see the module docstring): the kernels to SASS,
        # the op bindings without code generation (the check links no library), side by side.
        kernels = build_dir / "kernels.o"
        _run_all([[nvcc, "-c", *nvcc_flags, *includes, str(_one_unit(build_dir / "kernels.cu", cuda_sources)),
                   "-o", str(kernels)],
                  [cxx, "-fsyntax-only", "-std=c++20", abi, *host_includes,
                   str(_one_unit(build_dir / "bindings.cpp", host_sources))]])
        # What a full build's link does implicitly, as its own step: the relocatable objects
        # device-link against libnvshmem_device.
        dlink = build_dir / "dlink.o"
        _run([nvcc, "-dlink", "-Xcompiler", "-fPIC", *gencode, str(kernels), f"-L{nv / 'lib'}",
              "-lnvshmem_device", "-o", str(dlink)])
        return dlink

    cuda_objects = [build_dir / _object_name(src) for src in cuda_sources]
    _run_all([[nvcc, "-c", *nvcc_flags, *includes, str(src), "-o", str(obj)]
              for src, obj in zip(cuda_sources, cuda_objects)])
    host_objects = [build_dir / _object_name(src) for src in host_sources]
    _run_all([[cxx, "-c", "-O2", "-std=c++20", "-fPIC", abi, *host_includes, str(src), "-o", str(obj)]
              for src, obj in zip(host_sources, host_objects)])
    library = out_dir / LIBRARY_NAME
    torch_lib = Path(torch.__file__).parent / "lib"
    # nvcc links (and device-links) the relocatable objects itself, with its static cudart.
    _run([nvcc, "-shared", "-Xcompiler", "-fPIC", *gencode, "-o", str(library),
          *map(str, cuda_objects + host_objects), f"-L{torch_lib}", "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu",
          "-ltorch_cuda", f"-L{nv / 'lib'}", "-lnvshmem_device", "-l:libnvshmem_host.so.3",
          "-Xlinker", "-rpath", "-Xlinker", str(nv / "lib"), "-Xlinker", "-rpath", "-Xlinker", str(torch_lib)])
    shutil.rmtree(build_dir, ignore_errors=True)
    return library


def library_path(archs: tuple[str, ...] | None = None) -> Path:
    """The built library for this GPU (MOE_COMM_LIBRARY if set), building it on first use.

    Processes of one machine take turns (a lock file beside the cache entry), so eight ranks
    that each start a one-rank EP group compile it once, not eight times side by side; each
    build still lands by an atomic rename, which keeps processes of several machines sharing
    one cache folder (a shared filesystem, where the lock may not reach) safe too.
    """
    prebuilt = os.environ.get("MOE_COMM_LIBRARY")
    if prebuilt:
        return Path(prebuilt)
    archs = archs or (current_arch(),)
    library = default_cache_dir() / cache_key(archs) / LIBRARY_NAME
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            tmp = library.parent / f"build-{os.getpid()}"
            os.replace(build(archs, tmp), library)
            shutil.rmtree(tmp, ignore_errors=True)
    return library


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS),
                        help="SM architectures, e.g. 90 (H100/H200) 100 (B200)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: the cache folder used at run time)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and device-link only (no GPU torch needed); what CI runs")
    parser.add_argument("--verbose", action="store_true", help="print ptxas register/spill reports")


def main(args: argparse.Namespace) -> int:
    archs = tuple(args.arch)
    out = args.out or (default_cache_dir() / (cache_key(archs) + ("-check" if args.compile_only else "")))
    path = build(archs, out, compile_only=args.compile_only, verbose=args.verbose)
    print(f"built {path}")
    if not args.compile_only:
        print(f"use it with MOE_COMM_LIBRARY={path} (or leave it in the cache: {default_cache_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main(argparse.ArgumentParser().parse_args()))
