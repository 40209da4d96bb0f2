"""Process-wide NVSHMEM state for the nvshmem backend: the library, start-up and teardown.

One process serves one expert-parallel group; every MoE layer shares the same buffers (the
kernels make that safe, see csrc/runtime/buffers.h). NVSHMEM is bootstrapped by unique ID over
the EP group's torch.distributed group, so it works the same under torchrun and srun, with NCCL
or gloo (several ranks sharing one GPU).

Teardown is agreed before it is done: NVSHMEM's collective teardown waits without a bound for
every peer, so `finalize` first asks the ranks, through the job's store with a bound
(moe_comm.kernels.peers), whether all of them reached it with no wait given up; only then do
they tear NVSHMEM down together. Otherwise each skips it with a one-line note (the process's
exit frees the GPU memory), so a peer that died, hangs or gave up never holds the others.

The node layout comes from the ranks themselves: the ranks of one host must be consecutive in
the EP group and equally many per host (TorchTitan's meshes place them so); `[moe_comm]
virtual_node_size` splits a host into smaller nodes, so the inter-node protocol runs between
ranks of one machine. The NVSHMEM transport follows: none on one host (no InfiniBand probing),
the cluster's (NVSHMEM_REMOTE_TRANSPORT from the platform env file) on several.

On one host NVSHMEM's proxy thread is turned off too (`ONE_HOST_ENV`). There it serves only
NVSHMEM's own device-side wait timeouts and global exit, neither of which the kernels use (their
waits are bounded by wait_timeout_s), and it spins on one CPU core without pause for the life of
the process (nvshmemi_proxy_progress_minimal), taking that core from the training process's
own threads: the Python thread that issues every kernel, the autograd thread, the data loader
(results/h200x1/README.md, host time). Across hosts the proxy drives the network transport and
stays.
"""

import atexit
import hashlib
import os
import socket
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_comm.kernels.build import library_path
from moe_comm.kernels.capacity import BufferSizes, buffer_sizes
from moe_comm.kernels.errors import KernelErrors
from moe_comm.kernels.limits import LIMITS
from moe_comm.kernels.peers import job_store, PeerBoard

INIT_TIMEOUT_S = float(os.environ.get("MOE_COMM_INIT_TIMEOUT", "180"))
# Once every rank has said it reached the teardown cleanly, the time each may take to post that
# it will tear down together (they post it at once; this bounds a process descheduled meanwhile).
TEARDOWN_DECISION_TIMEOUT_S = 5.0
# Headroom on top of what the buffers need: NVSHMEM keeps some of the heap for itself.
HEAP_HEADROOM_BYTES = 256 << 20
# What NVSHMEM gets when the EP group is on one host (set unless the environment sets it).
ONE_HOST_ENV = {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1"}
NETWORK_TRANSPORTS = ("ibrc", "ibgda", "ucx", "libfabric", "ibdevx")

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
class RuntimeRequest:
    """What a backend needs the buffers to hold; every MoE layer of a run asks the same."""

    tokens: int  # most tokens one rank dispatches per call
    num_experts: int
    top_k: int
    row_bytes: int  # hidden x element size of the widest rows the run moves
    recv_capacity_factor: float
    virtual_node_size: int  # 0: the real node
    wait_timeout_s: float


@dataclass(frozen=True)
class NodeLayout:
    hosts: int  # distinct hosts the EP group spans
    ranks_per_node: int  # as the kernels see it (virtual nodes included)


def node_layout(group: dist.ProcessGroup, virtual_node_size: int) -> NodeLayout:
    """The EP group's hosts (all-gathered hostnames), checked to be consecutive equal blocks."""
    world = dist.get_world_size(group)
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    per_host = hosts.count(hosts[0])
    blocks = [hosts[i:i + per_host] for i in range(0, world, per_host)]
    if world % per_host or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise RuntimeError(
            f"the EP group's ranks are not equal consecutive blocks per host ({hosts}); the nvshmem backend needs "
            "the ranks of one host next to each other in the EP group, equally many on every host"
        )
    per_node = virtual_node_size or per_host
    if per_host % per_node != 0:
        raise RuntimeError(
            f"[moe_comm] virtual_node_size = {virtual_node_size} does not divide the {per_host} ranks per host"
        )
    if per_node > LIMITS.max_ranks_per_node:
        raise RuntimeError(
            f"{per_node} ranks per node: the nvshmem kernels serve up to {LIMITS.max_ranks_per_node} "
            "(one NVLink domain of a B200/H200 node); set [moe_comm] virtual_node_size"
        )
    return NodeLayout(hosts=len(blocks), ranks_per_node=per_node)


class NvshmemRuntime:
    """NVSHMEM initialised over one EP group, with buffers sized for one RuntimeRequest."""

    def __init__(self, group: dist.ProcessGroup, request: RuntimeRequest, layout: NodeLayout, sizes: BufferSizes):
        self.group = group
        self.request = request
        self.layout = layout
        self.sizes = sizes
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.board: PeerBoard | None = None  # set once NVSHMEM's unique id is known

    @classmethod
    def start(cls, group: dist.ProcessGroup, request: RuntimeRequest) -> "NvshmemRuntime":
        """Start once per process; later calls must fit the first one's buffers."""
        running = current()
        if running is not None:
            if dist.get_process_group_ranks(running.group) != dist.get_process_group_ranks(group):
                raise RuntimeError(
                    "the nvshmem backend serves one EP group per process; every MoE layer must use the same group"
                )
            if request.tokens > running.request.tokens or request.row_bytes > running.request.row_bytes:
                raise RuntimeError(
                    f"the nvshmem buffers hold {running.request.tokens} tokens of {running.request.row_bytes} bytes "
                    f"per rank, but a call needs {request.tokens} of {request.row_bytes}; set [moe_comm] "
                    "max_tokens_per_rank to the largest local batch_size * seq_len the run uses"
                )
            return running
        load_library(group)
        layout = node_layout(group, request.virtual_node_size)
        sizes = buffer_sizes(request.tokens, request.num_experts, request.top_k, request.row_bytes,
                             dist.get_world_size(group), layout.ranks_per_node, request.recv_capacity_factor)
        runtime = cls(group, request, layout, sizes)
        runtime._init_nvshmem()
        global _runtime
        _runtime = runtime
        atexit.register(runtime.finalize)
        return runtime

    def _init_nvshmem(self) -> None:
        s = self.sizes
        needed = torch.ops.moe_comm.runtime_symmetric_bytes(s.shape, s.tokens, s.send_slots, s.row_bytes)
        heap = needed + HEAP_HEADROOM_BYTES
        user_heap = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
        if user_heap is None:
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
        elif _parse_size(user_heap) < heap:
            raise RuntimeError(
                f"NVSHMEM_SYMMETRIC_SIZE={user_heap} is below the {heap} bytes the nvshmem backend needs "
                f"({s.tokens} tokens x {s.row_bytes} bytes, {self.world} ranks); unset it or raise it"
            )
        transport = os.environ.get("NVSHMEM_REMOTE_TRANSPORT")
        if self.layout.hosts == 1:  # no InfiniBand probing, no proxy thread (module doc)
            for name, value in ONE_HOST_ENV.items():
                os.environ.setdefault(name, value)
        elif transport is None or transport.lower() not in NETWORK_TRANSPORTS:
            raise RuntimeError(
                f"the EP group spans {self.layout.hosts} hosts but NVSHMEM_REMOTE_TRANSPORT={transport!r}; set it "
                f"to one of {NETWORK_TRANSPORTS} (the platform env file, [cluster] env_file, does on Nebius)"
            )

        uid = [torch.ops.moe_comm.runtime_unique_id() if self.rank == 0 else None]
        dist.broadcast_object_list(uid, src=dist.get_global_rank(self.group, 0), group=self.group)
        job = hashlib.sha1(bytes(uid[0].tolist())).hexdigest()[:16]  # one NVSHMEM job's posts
        self.board = PeerBoard(job_store(), f"moe_comm/nvshmem/{job}", self.world, self.rank)

        done = threading.Event()
        watchdog = threading.Thread(target=self._watch_init, args=(done,), daemon=True)
        watchdog.start()
        try:
            torch.ops.moe_comm.runtime_init(uid[0], self.rank, s.shape, s.tokens, s.send_slots, s.row_bytes,
                                            self.request.wait_timeout_s)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self._init_hints()}") from e
        finally:
            done.set()

    def _init_hints(self) -> str:
        hints = ["every rank of the EP group must start the nvshmem backend (the same recipe on every rank)"]
        if self.layout.hosts > 1:
            hints += [
                "NVSHMEM_HCA_LIST must name the InfiniBand devices that exist (ibv_devinfo), without virtual ones",
                "IBGDA (NVSHMEM_IB_ENABLE_IBGDA=1) needs the driver options NVreg_EnableStreamMemOPs=1 and "
                "PeerMappingOverride=1, and `ulimit -l unlimited`",
                "IBRC without GDRCopy is slow but works: check the gdrdrv module if NVSHMEM warns about it",
                "run `python -m moe_comm preflight` under srun on the job's nodes to test each pair",
            ]
        else:
            hints += ["the GPUs of one host must be NVLink peers (nvidia-smi topo -m)"]
        return "Likely causes: " + "; ".join(hints) + ". Raise MOE_COMM_INIT_TIMEOUT if start-up is merely slow."

    def _watch_init(self, done: threading.Event) -> None:
        if done.wait(INIT_TIMEOUT_S):
            return
        print(
            f"moe_comm: NVSHMEM start-up did not finish within {INIT_TIMEOUT_S:.0f} s on EP rank {self.rank} of "
            f"{self.world} ({self.layout.hosts} host(s), {self.layout.ranks_per_node} ranks per node). "
            + self._init_hints(),
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    def finalize(self) -> None:
        """Tear NVSHMEM down: together when every rank of the group reached this point with no
        wait given up (agreed through the job's store, bounded), else alone, skipping NVSHMEM's
        collective teardown with a one-line note. Bounded either way: wait_timeout_s for a peer
        that never arrives, TEARDOWN_DECISION_TIMEOUT_S more once all have."""
        global _runtime
        if _runtime is not self:
            return
        _runtime = None
        torch.cuda.synchronize()  # every kernel's waits are bounded, so this returns
        together, why = self.agree_teardown()
        torch.ops.moe_comm.runtime_finalize(together)
        if not together:
            print(f"moe_comm: NVSHMEM's collective teardown skipped on EP rank {self.rank} of {self.world}: {why}",
                  file=sys.stderr, flush=True)

    def agree_teardown(self) -> tuple[bool, str]:
        """(tear down together, why not). A rank whose own wait gave up never does; a clean
        rank does only if every rank posts "clean" within wait_timeout_s and then every rank
        posts that it will, so no rank enters NVSHMEM's unbounded barrier alone."""
        mine = "aborted" if self.errors().timeout_kernel else "clean"
        board = self.board
        if board is None:
            return False, "the job's store was never reached"
        board.post("teardown", mine)
        if mine == "aborted":
            board.post("teardown-together", "no")
            return False, "a wait of this rank gave up"
        arrived = board.gather("teardown", self.request.wait_timeout_s)
        missing = sorted(set(range(self.world)) - set(arrived))
        aborted = sorted(r for r, v in arrived.items() if v != "clean")
        ok = not missing and not aborted
        board.post("teardown-together", "yes" if ok else "no")
        if not ok:
            if aborted:
                return False, f"EP rank(s) {aborted} gave up waiting for a peer"
            return False, (f"EP rank(s) {missing} did not reach the end within wait_timeout_s = "
                           f"{self.request.wait_timeout_s:g} s (dead, hung or still busy)")
        decided = board.gather("teardown-together", TEARDOWN_DECISION_TIMEOUT_S)
        disagree = sorted(r for r in range(self.world) if decided.get(r) != "yes")  # "no", or not heard
        if disagree:
            return False, f"EP rank(s) {disagree} did not agree"
        return True, ""

    @staticmethod
    def errors(clear: bool = False) -> KernelErrors:
        """The kernels' error words as the GPU wrote them so far (no synchronisation)."""
        return KernelErrors.from_words(torch.ops.moe_comm.runtime_errors(clear))


_runtime: NvshmemRuntime | None = None


def current() -> NvshmemRuntime | None:
    """The running runtime of this process, if any."""
    return _runtime


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)
