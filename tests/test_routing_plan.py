"""moe_comm.predict.routing_plan against a pure-Python loop over tokens, hand-counted layouts, and
NOTES §7's table of how far a DeepSeek-V3 token travels."""

import pytest
import torch

from moe_comm.predict.routing_plan import (
    ROUTINGS,
    Draw,
    draw_topk,
    plan,
    routing_statistics,
)


def loop_model(idx, num_experts, G):
    """The routing rules, one token at a time, in plain Python."""
    W, T, K = len(idx), len(idx[0]), len(idx[0][0])
    N, L = W // G, num_experts // W
    net = [[0] * N for _ in range(W)]
    nvl = [[0] * W for _ in range(W)]
    fwd = [[0] * W for _ in range(W)]
    slots, kept, own = [0] * W, [0] * W, [0] * W
    slots_from = [[0] * W for _ in range(W)]
    experts = [[0] * L for _ in range(W)]
    picks = [[0] * W for _ in range(W)]
    node_pairs = rank_pairs = 0
    for s in range(W):
        home = s // G
        for t in range(T):
            ranks = set()
            for e in idx[s][t]:
                experts[e // L][e % L] += 1
                picks[s][e // L] += 1
                ranks.add(e // L)
            nodes = {r // G for r in ranks}
            node_pairs += len(nodes)
            rank_pairs += len(ranks)
            for m in nodes:
                holder = s if m == home else m * G + s % G
                if m != home:
                    net[s][m] += 1  # one row per remote node hit
                for d in ranks:
                    if d // G != m:
                        continue
                    slots[d] += 1
                    slots_from[s][d] += 1
                    if d == holder:
                        (own if m == home else kept)[d] += 1
                    else:
                        nvl[holder][d] += 1  # one row per rank hit on that node
                        if m != home:
                            fwd[holder][d] += 1
    return dict(net=net, nvl=nvl, fwd=fwd, slots=slots, slots_from=slots_from, kept=kept, own=own, experts=experts,
                picks=picks, node_pairs=node_pairs, rank_pairs=rank_pairs)


def all_to_one_node(world, tokens, num_experts, top_k, seed):
    """Every token's experts on the ranks of node 0 (G ranks), so only node 0 receives."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(world * tokens, num_experts, generator=g)[:, : num_experts // world * 2].topk(
        top_k, dim=1
    ).indices.view(world, tokens, top_k)


def assert_matches(idx, E, G):
    p = plan(idx, E, G)
    ref = loop_model(idx.tolist(), E, G)
    assert p.network_rows_WN.tolist() == ref["net"]
    assert p.nvlink_rows_WW.tolist() == ref["nvl"]
    assert p.forwarded_rows_WW.tolist() == ref["fwd"]
    assert p.recv_slots_W.tolist() == ref["slots"]
    assert p.slots_from_WW.tolist() == ref["slots_from"]
    assert p.kept_forwarded_W.tolist() == ref["kept"]
    assert p.own_slots_W.tolist() == ref["own"]
    assert p.expert_rows_WL.tolist() == ref["experts"]
    assert p.pick_rows_WW.tolist() == ref["picks"]
    assert p.token_node_pairs == ref["node_pairs"] and p.token_rank_pairs == ref["rank_pairs"]
    T, K = idx.shape[1], idx.shape[2]
    assert p.node_dedup == pytest.approx(K * idx.shape[0] * T / ref["node_pairs"])
    assert p.rank_dedup == pytest.approx(K * idx.shape[0] * T / ref["rank_pairs"])
    return p


# nodes x ranks per node, experts per rank
LAYOUTS = [(1, 4, 2), (2, 1, 4), (2, 2, 2), (4, 1, 2), (2, 4, 1), (4, 2, 2), (8, 2, 1), (16, 1, 1), (32, 1, 1), (32, 2, 1)]


@pytest.mark.parametrize("nodes,G,per_rank", LAYOUTS)
@pytest.mark.parametrize("routing", ["random", "balanced", "zipf", "all_to_one_node"])
@pytest.mark.parametrize("top_k", [1, 8])
def test_plan_matches_the_loop_model(nodes, G, per_rank, routing, top_k):
    W = nodes * G
    E = W * per_rank
    top_k = min(top_k, E if routing != "all_to_one_node" else 2 * per_rank)
    T = 7
    if routing == "all_to_one_node":
        if W < 2:
            pytest.skip("needs two ranks")
        idx = all_to_one_node(W, T, E, top_k, seed=nodes * 100 + G)
    else:
        idx = draw_topk(routing, W, T, E, top_k, seed=nodes * 100 + G)
    p = assert_matches(idx, E, G)
    if routing == "all_to_one_node":  # experts on ranks 0 and 1: node 0 (and node 1 when G = 1)
        assert p.recv_slots_W[2:].sum() == 0


@pytest.mark.parametrize("nodes,G", [(2, 4), (4, 2), (8, 4), (32, 8)])
def test_plan_matches_the_loop_model_node_limited(nodes, G):
    W = nodes * G
    E = 256 if W <= 256 else W
    idx = draw_topk("node_limited", W, 5, E, 8, seed=W)
    p = assert_matches(idx, E, G)
    # DeepSeek-V3's group limit: a token's experts lie in at most 4 of the 8 groups, so it
    # reaches at most 4 x (nodes a group spans) nodes
    groups = idx // (E // 8)
    per_token = torch.zeros(W, 5, 8, dtype=torch.bool).scatter_(2, groups, True).sum(2)
    assert int(per_token.max()) <= 4
    assert p.nodes_hit_per_token <= 4 * max(nodes // 8, 1)


def test_hand_counted_two_nodes_of_two():
    """W = 4: node 0 = ranks {0, 1}, node 1 = {2, 3}; 8 experts, 2 per rank; 2 tokens per rank.
    Rank 0: token 0 -> experts 1, 2, 5, 7 (ranks 0, 1, 2, 3); token 1 -> 4, 5, 6, 3 (2, 2, 3, 1).
    Ranks 1-3: both tokens -> experts 2, 3, 0, 1 (ranks 1, 1, 0, 0), all on node 0.
      rank 0: one row per token to node 1, to its forwarder rank 2 (local index 0); rank 2
              keeps both (experts 4, 5) and forwards both to rank 3; over NVLink rank 0 sends
              both tokens to rank 1.
      rank 1: both tokens stay on node 0; it keeps them and sends both to rank 0.
      rank 2: two rows to node 0's local index 0, rank 0, which keeps them and forwards both to 1.
      rank 3: two rows to rank 1 (local index 1), which keeps them and forwards both to 0."""
    idx = torch.tensor([[2, 3, 0, 1]]).repeat(4, 2, 1)
    idx[0] = torch.tensor([[1, 2, 5, 7], [4, 5, 6, 3]])
    p = plan(idx, 8, 2)
    assert p.network_rows_WN.tolist() == [[0, 2], [0, 0], [2, 0], [2, 0]]
    assert p.network_rows_in_W.tolist() == [2, 2, 2, 0]
    assert p.nvlink_rows_WW.tolist() == [[0, 4, 0, 0], [4, 0, 0, 0], [0, 0, 0, 2], [0, 0, 0, 0]]
    assert p.forwarded_rows_WW.tolist() == [[0, 2, 0, 0], [2, 0, 0, 0], [0, 0, 0, 2], [0, 0, 0, 0]]
    assert p.kept_forwarded_W.tolist() == [2, 2, 2, 0]
    assert p.own_slots_W.tolist() == [1, 2, 0, 0]
    assert p.recv_slots_W.tolist() == [7, 8, 2, 2]
    assert p.slots_from_WW.tolist() == [[1, 2, 2, 2], [2, 2, 0, 0], [2, 2, 0, 0], [2, 2, 0, 0]]
    assert p.expert_rows_WL.tolist() == [[6, 7], [7, 7], [1, 2], [1, 1]]
    assert p.padded_expert_rows_WL(8).tolist() == [[8, 8], [8, 8], [8, 8], [8, 8]]
    assert p.pick_rows_WW[0].tolist() == [1, 2, 3, 2]
    # 8 tokens: rank 0's hit 2 nodes each, the rest 1 -> 10 (token, node) pairs; ranks: 4 + 3 + 6 x 2
    assert (p.token_node_pairs, p.token_rank_pairs) == (10, 19)
    assert p.node_dedup == pytest.approx(4 * 8 / 10) and p.rank_dedup == pytest.approx(4 * 8 / 19)
    assert_matches(idx, 8, 2)


def test_intranode_is_the_one_node_case():
    """G = W: no network row, and each token sends one row per other rank it hits."""
    idx = draw_topk("random", 4, 64, 32, 8, seed=3)
    p = plan(idx, 32, 4)
    assert p.network_rows_WN.sum() == 0 and p.forwarded_rows_WW.sum() == 0
    hits = torch.zeros(4, 64, 4, dtype=torch.bool)
    hits.scatter_(2, idx // 8, True)
    for s in range(4):
        for d in range(4):
            expected = 0 if s == d else int(hits[s, :, d].sum())
            assert p.nvlink_rows_WW[s, d] == expected


def test_padding_and_errors():
    idx = torch.tensor([[[0, 1], [0, 2]], [[3, 2], [3, 1]]])
    p = plan(idx, 4, 1)
    assert p.expert_rows_WL.tolist() == [[2, 2], [2, 2]]
    assert p.padded_expert_rows_WL(8).tolist() == [[8, 8], [8, 8]]
    with pytest.raises(ValueError, match="ranks_per_node = 3"):
        plan(idx, 4, 3)
    with pytest.raises(ValueError, match="num_experts = 3"):
        plan(idx, 3, 1)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        plan(idx + 4, 4, 1)
    with pytest.raises(ValueError, match="routing = 'uniform'"):
        draw_topk("uniform", 2, 4, 8, 2)


def test_balanced_is_torchtitan_round_robin():
    """--debug.moe_force_load_balance: every expert the same rows; at EP 32 on 4 nodes with
    8 experts per rank every token lands on exactly one rank, 3/4 of them on another node."""
    s = routing_statistics("balanced", 32, 8, 256, 8)
    assert s.ranks_hit_per_token == 1.0 and s.nodes_hit_per_token == 1.0
    assert s.mean["network_out"] == pytest.approx(0.75)
    assert s.max["expert_rows"] == s.mean["expert_rows"] == 8.0
    assert s.mean["a2a_network_out"] == pytest.approx(6.0)  # 8 picks x 3/4, no dedup


# NOTES §7: nodes hit, ranks hit, experts per rank hit, experts per node hit
NOTES_TABLE = {8: (1.00, 3.95, 2.02, 8.00), 16: (1.97, 5.73, 1.40, 4.07), 32: (3.12, 6.86, 1.17, 2.57),
               64: (3.95, 7.49, 1.07, 2.02), 256: (6.86, 8.00, 1.00, 1.17)}


@pytest.mark.parametrize("ep", sorted(NOTES_TABLE))
def test_node_limited_statistics_reproduce_notes_table(ep):
    nodes, ranks, per_rank, per_node = NOTES_TABLE[ep]
    s = routing_statistics("node_limited", ep, 8, 256, 8, tokens=1024 if ep == 256 else 2048)
    assert s.nodes_hit_per_token == pytest.approx(nodes, abs=0.02)
    assert s.ranks_hit_per_token == pytest.approx(ranks, abs=0.02)
    assert s.rank_dedup == pytest.approx(per_rank, abs=0.02)
    assert s.node_dedup == pytest.approx(per_node, abs=0.03)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_one_draw_serves_every_ep_degree(routing):
    """The first W ranks of a longer draw are the draw for W ranks, however it was extended, so
    routing_statistics at EP 8 ... 256 share one draw (a plan drew each EP degree afresh)."""
    long_WTK = draw_topk(routing, 8, 100, 64, 6, seed=5)
    assert torch.equal(draw_topk(routing, 3, 100, 64, 6, seed=5), long_WTK[:3])
    d = Draw(routing, 100, 64, 6, seed=5)
    assert torch.equal(d.ranks(3), long_WTK[:3]) and torch.equal(d.ranks(8), long_WTK)
    assert torch.equal(d.ranks(5), long_WTK[:5])
    fresh = routing_statistics.__wrapped__(routing, 8, 4, 64, 6, tokens=100, seed=5)
    routing_statistics(routing, 16, 4, 64, 6, tokens=100, seed=5)  # extends the shared draw first
    assert routing_statistics(routing, 8, 4, 64, 6, tokens=100, seed=5) == fresh
