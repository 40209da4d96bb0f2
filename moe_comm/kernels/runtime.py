"""Process-wide NVSHMEM state for the nvshmem backend: the library, start-up and teardown.

One process serves one expert-parallel group; every MoE layer shares the same symmetric buffers
(the kernels make that safe, see csrc/buffers.h). NVSHMEM is bootstrapped by unique ID over the
EP group's torch.distributed process group, so it works the same under torchrun and srun.
"""

import atexit
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_comm.kernels.build import library_path

INIT_TIMEOUT_S = float(os.environ.get("MOE_COMM_INIT_TIMEOUT", "180"))
# Headroom on top of what the buffers need: NVSHMEM keeps some of the heap for itself.
HEAP_HEADROOM_BYTES = 256 << 20

_library_loaded = False


def load_library(group: dist.ProcessGroup | None = None) -> None:
    """Build (first use) and load csrc/ as torch.ops.moe_comm.*. With a group, rank 0 builds
    while the others wait, so ranks of one node do not compile the same thing at once."""
    global _library_loaded
    if _library_loaded:
        return
    if group is not None and dist.get_world_size(group) > 1:
        if dist.get_rank(group) == 0:
            library_path()
        dist.barrier(group=group)
    torch.ops.load_library(str(library_path()))
    from moe_comm.kernels import ops  # noqa: F401  registers autograd and fake kernels

    _library_loaded = True


@dataclass(frozen=True)
class RuntimeShape:
    """What the buffers are sized for; fixed for the life of the process."""

    max_tokens: int
    max_row_bytes: int
    max_blocks: int


class NvshmemRuntime:
    """NVSHMEM initialised over one EP group, with buffers of one RuntimeShape."""

    _current: "NvshmemRuntime | None" = None

    def __init__(self, group: dist.ProcessGroup, shape: RuntimeShape):
        self.group = group
        self.shape = shape
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    @classmethod
    def start(cls, group: dist.ProcessGroup, max_tokens: int, max_row_bytes: int) -> "NvshmemRuntime":
        """Start once per process; later calls must fit the first one's buffers."""
        max_row_bytes = (max_row_bytes + 15) // 16 * 16
        if cls._current is not None:
            current = cls._current
            if dist.get_process_group_ranks(current.group) != dist.get_process_group_ranks(group):
                raise RuntimeError("the nvshmem backend serves one expert-parallel group per process")
            if max_tokens > current.shape.max_tokens or max_row_bytes > current.shape.max_row_bytes:
                raise RuntimeError(
                    f"the nvshmem buffers hold {current.shape.max_tokens} tokens of "
                    f"{current.shape.max_row_bytes} bytes per rank, but a call needs {max_tokens} of "
                    f"{max_row_bytes}; set [moe_comm] max_tokens_per_rank to the largest local "
                    "batch_size * seq_len the run uses"
                )
            return current
        load_library(group)
        device = torch.device("cuda", torch.cuda.current_device())
        shape = RuntimeShape(max_tokens, max_row_bytes, torch.cuda.get_device_properties(device).multi_processor_count)
        runtime = cls(group, shape)
        runtime._init_nvshmem()
        cls._current = runtime
        atexit.register(runtime.finalize)
        return runtime

    def _init_nvshmem(self) -> None:
        needed = torch.ops.moe_comm.nvshmem_symmetric_bytes(self.world, self.shape.max_tokens, self.shape.max_row_bytes)
        heap = needed + HEAP_HEADROOM_BYTES
        user_heap = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
        if user_heap is None:
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
        elif _parse_size(user_heap) < heap:
            raise RuntimeError(
                f"NVSHMEM_SYMMETRIC_SIZE={user_heap} is below the {heap} bytes the nvshmem backend needs "
                f"({self.shape.max_tokens} tokens x {self.shape.max_row_bytes} bytes x {self.world} ranks); "
                "unset it or raise it"
            )
        # One node: no InfiniBand probing. Never NVLink multicast (NVLS).
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

        uid = [torch.ops.moe_comm.nvshmem_unique_id() if self.rank == 0 else None]
        dist.broadcast_object_list(uid, src=dist.get_global_rank(self.group, 0), group=self.group)

        done = threading.Event()
        watchdog = threading.Thread(target=self._watch_init, args=(done,), daemon=True)
        watchdog.start()
        try:
            torch.ops.moe_comm.nvshmem_init(
                uid[0], self.rank, self.world, self.shape.max_tokens, self.shape.max_row_bytes, self.shape.max_blocks
            )
        finally:
            done.set()

    def _watch_init(self, done: threading.Event) -> None:
        if done.wait(INIT_TIMEOUT_S):
            return
        print(
            f"moe_comm: NVSHMEM start-up did not finish within {INIT_TIMEOUT_S:.0f} s on EP rank "
            f"{self.rank} of {self.world}. Likely causes: another rank of the group did not start the "
            "nvshmem backend (every rank must run the same recipe); NVSHMEM probing a network "
            "transport (NVSHMEM_REMOTE_TRANSPORT=none on one node); the GPUs are not peers over "
            "NVLink (nvidia-smi topo -m). Raise MOE_COMM_INIT_TIMEOUT if start-up is merely slow.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    def finalize(self) -> None:
        if NvshmemRuntime._current is self:
            torch.ops.moe_comm.nvshmem_finalize()
            NvshmemRuntime._current = None

    @staticmethod
    def errors(clear: bool = False) -> tuple[int, bool, bool]:
        """(rows needed beyond capacity or 0, bad expert index seen, duplicate expert seen);
        read from mapped host memory without synchronising."""
        rows_needed, bad_index, duplicate = torch.ops.moe_comm.nvshmem_errors(clear)
        return rows_needed, bool(bad_index), bool(duplicate)


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)
