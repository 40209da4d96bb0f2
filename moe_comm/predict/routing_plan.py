"""Which rows travel where in one dispatch: the routing plan of the hierarchical (inter-node)
path, of the intranode path and of an all-to-all, computed from every rank's top-k ids.

The layout. W expert-parallel ranks, G ranks per node (the real node, or [moe_comm]
virtual_node_size), N = W / G nodes; rank r is local index r % G of node r // G. E experts,
L = E / W per rank; expert e lives on rank e // L. Each token on source rank s names K distinct
experts.

The hierarchical dispatch (the nvshmem kernels when N > 1, and DeepEP V1 internode):
  * network hop: for each node m the token hits (one of its experts is on a rank of m) other
    than its own node, ONE row crosses the network, from s to its forwarder on m, the rank with
    the same local index (m, s % G): per-node dedup;
  * NVLink forward: the forwarder - and for the token's own node, the source itself - sends
    ONE row over NVLink to each rank of that node that holds one of the token's experts, except
    itself: per-rank dedup.
With N == 1 only the NVLink phase exists (today's intranode path: s sends one row to each
other rank it hits). A receiver keeps one slot per distinct token that reaches it (over
NVLink, kept by the forwarder it arrived at, or its own token), and lays the slots out
expert-major, one row per (token, local expert) pick. Combine moves the same rows back, and
the backward pass repeats both, so these counts price all four transfers of a MoE layer.

An all-to-all (TorchTitan's "standard" path, our nccl backend) sends one row per pick to the
expert's rank, with no dedup: `pick_rows_WW`.

`plan` is vectorised torch on CPU, so the scale model and `check` can price EP 256 layouts;
`draw_topk` draws the routings they price (random, balanced, zipf-skewed, and DeepSeek-V3's
node-limited group routing), and `routing_statistics` turns a drawn routing into per-token
rates. tests/test_routing_plan.py checks `plan` against a pure-Python loop over tokens.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

ROUTINGS = ("random", "balanced", "zipf", "node_limited")

# TorchTitan's per-expert row alignment of the grouped GEMM input (TOKEN_GROUP_ALIGN_SIZE_M,
# torchtitan/models/moe/utils.py; the float8 and MXFP8 converters raise it).
GROUPED_GEMM_ALIGNMENT = {"bf16": 8, "fp8": 16, "mxfp8": 32}


@dataclass
class RoutingPlan:
    """Rows per phase of one dispatch (combine moves the same rows back)."""

    world: int
    ranks_per_node: int
    num_experts: int
    tokens_W: torch.Tensor  # tokens each rank dispatches
    top_k: int
    # [source s, node m]: rows s sends over the network to its forwarder on m (0 for s's node)
    network_rows_WN: torch.Tensor
    # [sender f, receiver d]: rows f sends over NVLink, its own tokens and forwarded ones
    # (0 across nodes and on the diagonal)
    nvlink_rows_WW: torch.Tensor
    # the part of nvlink_rows_WW that f received over the network first
    forwarded_rows_WW: torch.Tensor
    # slots each rank ends with: rows of distinct tokens that arrived over NVLink, or over the
    # network and stayed (the forwarder holds one of the token's experts), or its own tokens
    recv_slots_W: torch.Tensor
    kept_forwarded_W: torch.Tensor  # of recv_slots_W: arrived over the network and stayed
    own_slots_W: torch.Tensor  # of recv_slots_W: the rank's own tokens with an expert here
    slots_from_WW: torch.Tensor  # [source s, receiver d]: recv_slots_W split by the tokens' source
    expert_rows_WL: torch.Tensor  # (token, expert) picks per local expert, unpadded
    pick_rows_WW: torch.Tensor  # [s, d]: picks of s's tokens whose expert is on d (all-to-all)
    token_node_pairs: int  # distinct (token, node) pairs over all ranks
    token_rank_pairs: int  # distinct (token, rank) pairs over all ranks

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    @property
    def nodes_hit_per_token(self) -> float:
        return self.token_node_pairs / max(int(self.tokens_W.sum()), 1)

    @property
    def ranks_hit_per_token(self) -> float:
        return self.token_rank_pairs / max(int(self.tokens_W.sum()), 1)

    @property
    def node_dedup(self) -> float:
        """Picks per (token, node) pair: how many times fewer rows a per-node dedup sends than
        one row per expert ("experts per node hit"; tests/test_routing_plan.py's table)."""
        return self.top_k / self.nodes_hit_per_token

    @property
    def rank_dedup(self) -> float:
        """Picks per (token, rank) pair ("experts per rank hit"; tests/test_routing_plan.py's table)."""
        return self.top_k / self.ranks_hit_per_token

    @property
    def network_rows_in_W(self) -> torch.Tensor:
        """Rows each rank receives over the network, as the forwarder of its local index."""
        G, N = self.ranks_per_node, self.nodes
        s = torch.arange(self.world)
        forwarder_WN = torch.arange(N)[None, :] * G + (s % G)[:, None]
        return torch.zeros(self.world, dtype=torch.int64).index_add_(
            0, forwarder_WN.flatten(), self.network_rows_WN.flatten()
        )

    def padded_expert_rows_WL(self, align: int) -> torch.Tensor:
        """Expert rows with each expert's segment padded to the grouped-GEMM alignment."""
        return (self.expert_rows_WL + align - 1) // align * align

    def rank_loads(self) -> dict[str, torch.Tensor]:
        """Per-rank [W] row counts of one dispatch, each link direction apart."""
        G = self.ranks_per_node
        same_node = (torch.arange(self.world)[:, None] // G) == (torch.arange(self.world)[None, :] // G)
        off_diag = ~torch.eye(self.world, dtype=torch.bool)
        picks = self.pick_rows_WW
        return {
            "tokens": self.tokens_W,
            "network_out": self.network_rows_WN.sum(1),
            "network_in": self.network_rows_in_W,
            "nvlink_out": self.nvlink_rows_WW.sum(1),
            "nvlink_in": self.nvlink_rows_WW.sum(0),
            "forwarded_out": self.forwarded_rows_WW.sum(1),
            "recv_slots": self.recv_slots_W,
            "expert_rows": self.expert_rows_WL.sum(1),
            "a2a_network_out": (picks * ~same_node).sum(1),
            "a2a_network_in": (picks * ~same_node).sum(0),
            "a2a_nvlink_out": (picks * (same_node & off_diag)).sum(1),
            "a2a_nvlink_in": (picks * (same_node & off_diag)).sum(0),
        }


def plan(topk_idx_WTK: torch.Tensor, num_experts: int, ranks_per_node: int) -> RoutingPlan:
    """The routing plan of one dispatch, from every rank's top-k expert ids [W, T, K]."""
    if topk_idx_WTK.dim() != 3:
        raise ValueError(f"topk_idx must be [world, tokens, top_k], got shape {tuple(topk_idx_WTK.shape)}")
    W, T, K = topk_idx_WTK.shape
    G = ranks_per_node
    if G < 1 or W % G != 0:
        raise ValueError(f"ranks_per_node = {G} must divide the EP world size {W}")
    if num_experts % W != 0:
        raise ValueError(f"num_experts = {num_experts} is not divisible by the EP world size {W}")
    N, L = W // G, num_experts // W
    idx = topk_idx_WTK.to(torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts})")

    src_WTK = torch.arange(W).view(W, 1, 1).expand(W, T, K)
    dest_WTK = idx // L

    pick_rows_WW = torch.bincount(src_WTK.flatten() * W + dest_WTK.flatten(), minlength=W * W).view(W, W)
    expert_rows_WL = torch.bincount(idx.flatten(), minlength=num_experts).view(W, L)

    # distinct (token, rank) and (token, node) pairs: each token's picks that no earlier pick of
    # it shares (K x K comparisons per token, not a sort of every pick at once)
    d, s_r = _first_picks(dest_WTK)
    m, s_n = _first_picks(dest_WTK // G)

    remote_node = m != s_n // G
    network_rows_WN = torch.bincount((s_n * N + m)[remote_node], minlength=W * N).view(W, N)

    # who holds each (token, rank) pair's row on the destination node before the NVLink phase
    home = (d // G) == (s_r // G)
    holder = torch.where(home, s_r, (d // G) * G + s_r % G)
    moves = holder != d
    nvlink_rows_WW = torch.bincount((holder * W + d)[moves], minlength=W * W).view(W, W)
    forwarded_rows_WW = torch.bincount((holder * W + d)[moves & ~home], minlength=W * W).view(W, W)
    recv_slots_W = torch.bincount(d, minlength=W)
    slots_from_WW = torch.bincount(s_r * W + d, minlength=W * W).view(W, W)
    kept_forwarded_W = torch.bincount(d[~moves & ~home], minlength=W)
    own_slots_W = torch.bincount(d[~moves & home], minlength=W)

    return RoutingPlan(
        world=W, ranks_per_node=G, num_experts=num_experts, tokens_W=torch.full((W,), T, dtype=torch.int64),
        top_k=K, network_rows_WN=network_rows_WN, nvlink_rows_WW=nvlink_rows_WW,
        forwarded_rows_WW=forwarded_rows_WW, recv_slots_W=recv_slots_W, kept_forwarded_W=kept_forwarded_W,
        own_slots_W=own_slots_W, slots_from_WW=slots_from_WW, expert_rows_WL=expert_rows_WL, pick_rows_WW=pick_rows_WW,
        token_node_pairs=int(m.numel()), token_rank_pairs=int(d.numel()),
    )


def _first_picks(value_WTK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's distinct values, the source rank of each), from its K picks' values."""
    W, T, K = value_WTK.shape
    value_KX = value_WTK.permute(2, 0, 1).reshape(K, W * T)  # pick-major: each row contiguous
    first_KX = torch.ones_like(value_KX, dtype=torch.bool)
    for k in range(1, K):
        for j in range(k):
            first_KX[k] &= value_KX[k] != value_KX[j]
    src_KX = torch.arange(W).repeat_interleave(T).expand(K, W * T)
    return value_KX[first_KX], src_KX[first_KX]


def draw_topk(
    routing: str,
    world: int,
    tokens: int,
    num_experts: int,
    top_k: int,
    *,
    num_groups: int = 8,
    limited_groups: int = 4,
    zipf_exponent: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    """Top-k expert ids [world, tokens, top_k] of one MoE layer under a routing statistic.

    random        every token picks top_k distinct experts uniformly (top-k of i.i.d. scores).
    balanced      TorchTitan's --debug.moe_force_load_balance: token t takes the round-robin
                  ids (t * top_k + k) % num_experts on every rank (every expert gets the same
                  rows; with top_k consecutive ids a token usually lands on one rank);
                  experiments/bench_comm.py's "balanced" gives the same counts.
    zipf          experts' popularity falls as 1 / rank^zipf_exponent (a random order of hot
                  experts shared by all ranks); each token draws top_k distinct experts from it.
    node_limited  DeepSeek-V3's group-limited router on i.i.d. scores: num_groups groups of
                  consecutive experts, keep the limited_groups groups with the largest sum of
                  their two best scores, then top_k experts among those (TorchTitan 0.2.2's
                  router, torchtitan/models/moe/moe.py, with num_expert_groups and
                  num_limited_groups).
    """
    return Draw(routing, tokens, num_experts, top_k, num_groups=num_groups, limited_groups=limited_groups,
                zipf_exponent=zipf_exponent, seed=seed).ranks(world)


ROWS_PER_BATCH = 1 << 16  # tokens drawn at a time: EP 256's scores would take 1 GiB at once


class Draw:
    """`draw_topk`'s routing, rank after rank from one generator. The generator fills every
    tensor in order and each token's ids depend on its own scores only, so the first W ranks of
    a longer draw are the draw for W ranks, whatever the batches: `ranks(W)` extends the draw
    only as far as it is asked, and statistics at several EP degrees share one draw."""

    def __init__(self, routing: str, tokens: int, num_experts: int, top_k: int, *, num_groups: int = 8,
                 limited_groups: int = 4, zipf_exponent: float = 1.0, seed: int = 0):
        if routing not in ROUTINGS:
            raise ValueError(f"routing = {routing!r}: choose one of {list(ROUTINGS)}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k} must be between 1 and num_experts = {num_experts}")
        if routing == "node_limited":
            if num_experts % num_groups != 0 or not 1 <= limited_groups <= num_groups:
                raise ValueError(
                    f"node_limited routing needs num_groups ({num_groups}) to divide num_experts "
                    f"({num_experts}) and 1 <= limited_groups ({limited_groups}) <= num_groups"
                )
            if top_k > limited_groups * (num_experts // num_groups):
                raise ValueError(f"top_k = {top_k} exceeds the {limited_groups * (num_experts // num_groups)} "
                                 f"experts of {limited_groups} groups")
        self.routing, self.tokens, self.num_experts, self.top_k = routing, tokens, num_experts, top_k
        self.num_groups, self.limited_groups = num_groups, limited_groups
        self._g = torch.Generator().manual_seed(seed)
        if routing == "zipf":
            popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf_exponent
            self._log_weights = popularity[torch.argsort(torch.rand(num_experts, generator=self._g))].log()
        self._ids = torch.empty(0, top_k, dtype=torch.int64)  # [tokens drawn, top_k]

    def ranks(self, world: int) -> torch.Tensor:
        """Top-k ids [world, tokens, top_k] of the first `world` ranks."""
        T, K = self.tokens, self.top_k
        if self.routing == "balanced":
            ids = torch.arange(T * K, dtype=torch.int64).view(T, K) % self.num_experts
            return ids.expand(world, T, K).contiguous()
        rows = world * T
        if len(self._ids) < rows:
            drawn = [self._ids]
            for start in range(len(self._ids), rows, ROWS_PER_BATCH):
                drawn.append(self._batch(min(ROWS_PER_BATCH, rows - start)))
            self._ids = torch.cat(drawn)
        return self._ids[:rows].view(world, T, K)

    def _batch(self, rows: int) -> torch.Tensor:
        """The next `rows` tokens' top-k ids [rows, top_k]."""
        g, E, K = self._g, self.num_experts, self.top_k
        if self.routing == "random":
            return torch.rand(rows, E, generator=g).topk(K, dim=1).indices
        if self.routing == "zipf":
            # Gumbel top-k: sampling top_k without replacement in proportion to the weights
            gumbel = -torch.log(-torch.log(torch.rand(rows, E, generator=g, dtype=torch.float64)))
            return (self._log_weights + gumbel).topk(K, dim=1).indices
        groups = self.num_groups
        per_group = E // groups
        scores = torch.rand(rows, groups, per_group, generator=g)
        if per_group >= 2:  # the sum of each group's two best scores (two max passes: faster than topk)
            best, at = scores.max(2)
            group_score = best + scores.scatter(2, at[..., None], -1.0).max(2).values
        else:
            group_score = scores[:, :, 0]
        keep = group_score.topk(self.limited_groups, dim=1).indices
        # top_k among the kept groups' experts only (the same picks as masking the others out)
        kept = scores.gather(1, keep[:, :, None].expand(-1, -1, per_group)).reshape(rows, -1)
        pick = kept.topk(K, dim=1).indices
        return keep.gather(1, pick // per_group) * per_group + pick % per_group


@dataclass(frozen=True)
class PlanStats:
    """One dispatch's per-rank row counts as rates per dispatched token, mean and slowest rank
    (keys of RoutingPlan.rank_loads), plus the dedup figures; scale them by tokens per rank."""

    routing: str
    world: int
    ranks_per_node: int
    num_experts: int
    top_k: int
    mean: dict
    max: dict
    nodes_hit_per_token: float
    ranks_hit_per_token: float
    node_dedup: float
    rank_dedup: float

    def rows(self, key: str, tokens: float, slowest: bool = True) -> float:
        return (self.max if slowest else self.mean)[key] * tokens


# Tokens per rank drawn for statistics: enough that the slowest rank's count is the one of a
# real 4096-token microbatch, small enough that EP 256 stays around a second on a CPU.
SAMPLE_TOKENS = 4096


@lru_cache(maxsize=64)
def routing_statistics(
    routing: str, world: int, ranks_per_node: int, num_experts: int, top_k: int,
    num_groups: int = 8, limited_groups: int = 4, tokens: int = SAMPLE_TOKENS, seed: int = 0,
) -> PlanStats:
    """Draw a routing for every rank and summarise its plan per dispatched token (one draw,
    extended, serves every EP degree: `Draw`)."""
    ranks_per_node = min(ranks_per_node, world)
    idx = _shared_draw(routing, tokens, num_experts, top_k, num_groups, limited_groups, seed).ranks(world)
    p = plan(idx, num_experts, ranks_per_node)
    loads = p.rank_loads()
    return PlanStats(
        routing=routing, world=world, ranks_per_node=ranks_per_node, num_experts=num_experts, top_k=top_k,
        mean={k: float(v.double().mean()) / tokens for k, v in loads.items()},
        max={k: float(v.max()) / tokens for k, v in loads.items()},
        nodes_hit_per_token=p.nodes_hit_per_token, ranks_hit_per_token=p.ranks_hit_per_token,
        node_dedup=p.node_dedup, rank_dedup=p.rank_dedup,
    )


@lru_cache(maxsize=4)
def _shared_draw(routing: str, tokens: int, num_experts: int, top_k: int, num_groups: int, limited_groups: int,
                 seed: int) -> Draw:
    return Draw(routing, tokens, num_experts, top_k, num_groups=num_groups, limited_groups=limited_groups, seed=seed)


def row_bytes(hidden: int, dtype: str = "bf16", metadata: bool = True) -> float:
    """Bytes one row puts on a link: the hidden vector (bf16, or e4m3 plus one fp32 scale per
    128 channels) and, for our kernels and DeepEP, the slot metadata (csrc/common/wire.h: a net
    slot's NetMeta, 128 bytes, the larger of the two formats; NVLink deliveries carry 80)."""
    from moe_comm.kernels.capacity import NET_META_BYTES

    payload = hidden * 2 if dtype == "bf16" else hidden + hidden / 128 * 4
    meta = NET_META_BYTES if metadata else 0
    return payload + meta
