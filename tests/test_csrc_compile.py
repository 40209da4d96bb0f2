"""csrc/ compiles and device-links against the nvidia-nvshmem-cu13 wheel for H100/H200 and B200.

This is the CI guard for the CUDA kernels (CI has nvcc but no GPU): a kernel that does not
compile never lands. The GPU behaviour is tested by tests/test_nvshmem_gpu.py on the device.
"""

import concurrent.futures
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from in_process import run_verb

from moe_comm.kernels import build as build_module
from moe_comm.kernels.build import CSRC, cache_key, nvshmem_root


def test_nvshmem_wheel_has_what_the_build_needs():
    root = nvshmem_root()
    assert (root / "include" / "nvshmem.h").exists()
    assert (root / "lib" / "libnvshmem_device.a").exists()
    assert (root / "lib" / "libnvshmem_host.so.3").exists()


def test_kernels_compile_and_device_link_for_sm90_and_sm100(csrc_build):
    """`python -m moe_comm build --compile-only --arch 90 100`, as CI and a cluster image run it
    (conftest starts it at the beginning of the session, in the background)."""
    obj = csrc_build / "obj"
    assert (obj / "dlink.o").stat().st_size > 0
    assert sorted(p.name for p in obj.glob("*.o")) == ["dlink.o", "kernels.o"]
    # Every kernel and op binding of the tree, subfolders included, is in the check's one
    # translation unit of its language (the bindings compiled without code generation: the
    # build fails if one does not compile).
    kernels, bindings = sorted(CSRC.rglob("*.cu")), sorted(CSRC.rglob("*.cpp"))
    assert {"comm", "layout", "internode", "runtime"} <= {p.parent.name for p in kernels}
    assert {"comm", "experts", "ops", "runtime"} <= {p.parent.name for p in bindings}
    assert _included(obj / "kernels.cu") == kernels and _included(obj / "bindings.cpp") == bindings
    # both targets are real SASS (an ELF cubin each), not PTX left for the driver to compile
    assert _fatbin_entries(obj / "kernels.o") == [("cubin", 90), ("cubin", 100)]


def _included(unit: Path) -> list[Path]:
    return sorted(Path(line.split('"')[1]) for line in unit.read_text().splitlines())


FATBIN_MAGIC = 0xBA55ED50


def _fatbin_entries(obj: Path) -> list[tuple[str, int]]:
    """(kind, architecture) of each entry of the object's embedded fat binary, as cuobjdump
    --list-elf/--list-ptx would name them (this toolkit's image ships no cuobjdump). The layout:
    a 16-byte header (magic, version, header size, payload size), then entries, each a header
    (kind 1 PTX / 2 ELF, its header size, its payload size, the SM number at byte 28) and payload."""
    data = obj.read_bytes()
    start = data.find(struct.pack("<I", FATBIN_MAGIC))
    assert start >= 0, f"{obj.name} embeds no fat binary"
    _, _, header_size, payload_size = struct.unpack_from("<IHHQ", data, start)
    entries, at = [], start + header_size
    while at < start + header_size + payload_size:
        kind, _, entry_header, size = struct.unpack_from("<HHIQ", data, at)
        (arch,) = struct.unpack_from("<I", data, at + 28)
        entries.append(({1: "ptx", 2: "cubin"}.get(kind, str(kind)), arch))
        at += entry_header + size
    return entries


def test_cache_key_changes_with_the_architecture():
    assert cache_key(("90",)) != cache_key(("100",))


def test_cache_key_covers_headers_in_subfolders(tmp_path, monkeypatch):
    tree = tmp_path / "csrc"
    shutil.copytree(CSRC, tree)
    monkeypatch.setattr(build_module, "CSRC", tree)
    before = cache_key(("90",))
    header = tree / "common" / "limits.h"
    header.write_text(header.read_text() + "\n// touched\n")
    assert cache_key(("90",)) != before


def test_build_verb_is_wired():
    proc = run_verb("build", "--help")
    assert proc.returncode == 0 and "--compile-only" in proc.stdout


def test_the_check_parses_once_and_assembles_for_every_architecture(tmp_path, monkeypatch):
    """One cicc pass (the lowest architecture's PTX) while no file branches on __CUDA_ARCH__;
    one per architecture as soon as one does (its PTX then differs between them)."""
    assert build_module._check_gencode(("100", "90")) == ["-gencode", "arch=compute_90,code=[sm_100,sm_90]"]
    assert build_module._check_gencode(("90",)) == build_module._gencode(("90",))
    tree = tmp_path / "csrc"
    shutil.copytree(CSRC, tree)
    monkeypatch.setattr(build_module, "CSRC", tree)
    kernel = tree / "comm" / "dispatch.cu"
    kernel.write_text(kernel.read_text() + "\n#if __CUDA_ARCH__ >= 1000\n#endif\n")
    assert build_module._check_gencode(("90", "100")) == build_module._gencode(("90", "100"))


def test_the_check_fails_on_an_op_binding_that_does_not_compile(tmp_path, monkeypatch):
    """The op bindings (*.cpp) are checked without code generation, and still checked: a type
    error in one fails the build, naming the file."""
    tree = tmp_path / "csrc"
    (tree / "ops").mkdir(parents=True)
    (tree / "ops" / "kernel.cu").write_text("__global__ void kernel() {}\n")
    (tree / "ops" / "binding.cpp").write_text("int binding() { return undeclared_name; }\n")
    monkeypatch.setattr(build_module, "CSRC", tree)
    with pytest.raises(RuntimeError, match=r"(?s)-fsyntax-only.*binding\.cpp.*undeclared_name"):
        build_module.build(("90",), tmp_path / "out", compile_only=True)
    (tree / "ops" / "binding.cpp").write_text("int binding() { return 0; }\n")
    assert build_module.build(("90",), tmp_path / "out", compile_only=True).is_file()


def test_the_check_names_both_places_of_a_clash_between_files(tmp_path, monkeypatch):
    """The check compiles each language as one translation unit, so names private to one file
    must differ across csrc/; a clash fails it, naming both files."""
    tree = tmp_path / "csrc"
    (tree / "ops").mkdir(parents=True)
    (tree / "ops" / "kernel.cu").write_text("__global__ void kernel() {}\n")
    for name in ("a.cpp", "b.cpp"):
        (tree / "ops" / name).write_text("namespace { int check(int x) { return x; } }\n")
    monkeypatch.setattr(build_module, "CSRC", tree)
    with pytest.raises(RuntimeError, match=r"(?s)ops/b\.cpp.*redefinition.*ops/a\.cpp"):
        build_module.build(("90",), tmp_path / "out", compile_only=True)


# The most stack one of the FP8 experts' row kernels may keep (ptxas -v, the build's flags): their
# loops run once a row, and what lives in local memory is read there. A pointer returned to a
# member of the experts' walk once kept the whole walk there: 112 bytes of stack frame with spills
# in quantise_rows, 96 in gate_backward; then 8 and 0, and none since the quantisers multiply by
# their scale's reciprocal (csrc/common/vec.cuh).
ROW_KERNEL_STACK_BYTES = 0
ROW_KERNELS = ("quantise_rows", "gate", "gate_backward", "weights", "group_columns", "widen")


def test_the_row_kernels_keep_their_loops_out_of_local_memory(tmp_path):
    nvcc = str(build_module.cuda_home() / "bin" / "nvcc")

    def stack_frames(name):
        cmd = [nvcc, "-O3", "-std=c++17", "-rdc=true", "-gencode", "arch=compute_90,code=sm_90",
               "-Xptxas=-v", f"-I{CSRC}", "-c", str(CSRC / "experts" / f"{name}.cu"), "-o", str(tmp_path / f"{name}.o")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        return [int(b) for b in re.findall(r"(\d+) bytes stack frame", out)]

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        frames = dict(zip(ROW_KERNELS, pool.map(stack_frames, ROW_KERNELS)))
    assert all(frames.values()), f"ptxas reported no kernel of some file: {frames}"
    too_big = {name: f for name, f in frames.items() if max(f) > ROW_KERNEL_STACK_BYTES}
    assert not too_big, f"stack frames over {ROW_KERNEL_STACK_BYTES} bytes: {too_big}"
