"""What the ranks of one NVSHMEM job tell each other outside NVSHMEM, each read with a bound.

NVSHMEM's own collectives (nvshmem_barrier_all, nvshmem_free, nvshmem_finalize) wait without a
bound for every peer, and after a wait of our kernels has given up a peer may never come: it
died, it hangs, or it gave up too and left. So whatever must be agreed once a wait may have
failed (is it safe to tear NVSHMEM down together? what did each rank of the preflight measure?)
goes through the job's torch.distributed store instead: the rendezvous' TCP store, which
torchrun's agent hosts and which outlives any one rank, read with timeouts. A rank that does
not post within the bound is simply absent from the answer, and the caller says so.
"""

import time
from dataclasses import dataclass

import torch.distributed as dist

POLL_S = 0.05


def job_store() -> dist.Store:
    """The default process group's store (torchrun's rendezvous store under torchrun). Taken
    when NVSHMEM starts and kept: TorchTitan destroys the process group before the interpreter's
    exit, where the teardown still needs it."""
    return dist.distributed_c10d._get_default_store()


@dataclass
class PeerBoard:
    """One value per rank and name, posted once and gathered with a bound."""

    store: dist.Store
    prefix: str  # unique to one NVSHMEM job (its unique id), so reruns never read old posts
    ranks: int
    rank: int

    def _key(self, name: str, rank: int) -> str:
        return f"{self.prefix}/{name}/{rank}"

    def post(self, name: str, value: str) -> None:
        self.store.set(self._key(name, self.rank), value)
        self.store.add(f"{self.prefix}/{name}/count", 1)

    def read(self, name: str, rank: int, timeout_s: float) -> str | None:
        """What `rank` posted as `name`, waiting up to `timeout_s` for it (None if it never did)."""
        deadline = time.monotonic() + timeout_s
        key = self._key(name, rank)
        try:
            while not self.store.check([key]):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_S)
            return self.store.get(key).decode()
        except RuntimeError:  # DistStoreError included: the store's host is gone
            return None

    def gather(self, name: str, timeout_s: float) -> dict[int, str]:
        """rank -> value for every rank that posted `name` within `timeout_s` (this one
        included); an unreachable store answers with nothing rather than an exception."""
        deadline = time.monotonic() + timeout_s
        try:
            while self.store.add(f"{self.prefix}/{name}/count", 0) < self.ranks and time.monotonic() < deadline:
                time.sleep(POLL_S)
            return {r: self.store.get(self._key(name, r)).decode() for r in range(self.ranks)
                    if self.store.check([self._key(name, r)])}
        except RuntimeError:  # DistStoreError included: the store's host is gone, nobody can be heard
            return {}
