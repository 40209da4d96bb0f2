"""How big the nvshmem backend's buffers are, from the recipe alone (pure Python, so `check`
prints them on a login node and tests pin them on CPU).

Four kinds of slots (csrc/common/wire.h): per rank, T tokens per call, E experts, K picks, W
ranks of G per node, N = W / G nodes, L = E / W experts per rank.
  recv slots   one forwarder delivers to one rank: worst case N x T (every token of every rank
               of the rail hits this rank);
  net slots    one rank receives over the network: worst case (N - 1) x T;
  send slots   one rank stages for the network: exactly T x min(K, N - 1), always;
  expert rows  one rank hands its experts: worst case T x W x min(K, L).
With `recv_capacity_factor` f > 0 the first two and the expert rows hold f times their
expected load under uniform routing instead of the worst case (a token hits a given rank with
probability 1 - C(E - L, K) / C(E, K), a given node with 1 - C(E - G L, K) / C(E, K)); the
expert rows keep the project's established f x T x K. Rows beyond a capacity are never
dropped silently: the kernels raise an error naming the field.
"""

import math
from dataclasses import dataclass

from moe_comm.kernels.limits import LIMITS

# Bytes of a net/send slot's metadata (csrc/common/wire.h kNetMetaBytes) and of a recv slot's
# (sizeof(RecvMeta)).
NET_META_BYTES = 128
RECV_META_BYTES = 80


def hit_probability(num_experts: int, top_k: int, experts_there: int) -> float:
    """Chance that a token's top_k distinct experts include one of `experts_there` given ones,
    under uniform routing."""
    if experts_there >= num_experts:
        return 1.0
    miss = math.comb(num_experts - experts_there, top_k) / math.comb(num_experts, top_k)
    return 1.0 - miss


@dataclass(frozen=True)
class BufferSizes:
    ranks: int
    ranks_per_node: int
    tokens: int
    row_bytes: int
    fwd_slots: int  # recv slots per (forwarder, rank) partition
    net_slots: int
    send_slots: int

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    @property
    def shape(self) -> list[int]:
        """What the ops take as `shape`: [world, local_size, fwd_slots, net_slots]."""
        return [self.ranks, self.ranks_per_node, self.fwd_slots, self.net_slots]

    def symmetric_bytes(self) -> int:
        """The symmetric heap the buffers take (the large terms of csrc/runtime/runtime.cu's
        `symmetric_bytes`, which is exact at start-up)."""
        G, row = self.ranks_per_node, self.row_bytes
        recv = G * self.fwd_slots * (2 * row + RECV_META_BYTES + 4 * LIMITS.max_top_k + 4)
        net = self.net_slots * (NET_META_BYTES + 2 * row + 4 * LIMITS.max_top_k)
        send = self.send_slots * (NET_META_BYTES + 2 * row + 4 * LIMITS.max_top_k)
        return recv + net + send


def buffer_sizes(tokens: int, num_experts: int, top_k: int, row_bytes: int, ranks: int, ranks_per_node: int,
                 factor: float) -> BufferSizes:
    """Slot capacities for `tokens` per rank per call; factor 0 means the exact worst case."""
    nodes = ranks // ranks_per_node
    local = num_experts // ranks
    fwd_worst = nodes * tokens
    net_worst = (nodes - 1) * tokens
    if factor > 0:
        p_rank = hit_probability(num_experts, top_k, local)
        p_node = hit_probability(num_experts, top_k, local * ranks_per_node)
        fwd = min(fwd_worst, math.ceil(factor * nodes * tokens * p_rank))
        net = min(net_worst, math.ceil(factor * (nodes - 1) * tokens * p_node))
    else:
        fwd, net = fwd_worst, net_worst
    return BufferSizes(
        ranks=ranks, ranks_per_node=ranks_per_node, tokens=tokens, row_bytes=(row_bytes + 15) // 16 * 16,
        fwd_slots=fwd, net_slots=net, send_slots=tokens * min(top_k, nodes - 1),
    )


def expert_rows(tokens: int, num_experts: int, top_k: int, ranks: int, factor: float, align: int) -> int:
    """Rows one rank hands its experts (recv_x): the balanced load times `factor`, or the exact
    worst case when factor is 0, plus room for every local expert's alignment padding."""
    local = num_experts // ranks
    worst = tokens * ranks * min(top_k, local)
    rows = worst if factor <= 0 else min(worst, math.ceil(factor * tokens * top_k))
    return rows + local * (align - 1)
