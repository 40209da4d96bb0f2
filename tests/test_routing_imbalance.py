"""experiments/routing_imbalance.py on synthetic expert-count logs (the format
moe_comm.metrics.expert_counts writes): the busiest rank's load over the mean with experts in
contiguous blocks, redone here by hand; steps summed over rank files; the EP that 32 experts
cannot represent reported as not derivable with its bound; what it refuses."""

import importlib.util
import json
import random
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("routing_imbalance", REPO / "experiments" / "routing_imbalance.py")
ri = importlib.util.module_from_spec(spec)
sys.modules["routing_imbalance"] = ri
spec.loader.exec_module(ri)


def _counts(experts, top_k, tokens, rng, hot=()):
    """Per expert rows of `tokens` tokens, top_k each, with extra weight on `hot` experts."""
    weights = [3.0 if e in hot else 1.0 for e in range(experts)]
    counts = [0] * experts
    for _ in range(tokens):
        for e in _distinct(rng, weights, top_k):
            counts[e] += 1
    return counts


def _distinct(rng, weights, k):
    picked = set()
    while len(picked) < k:
        picked.add(rng.choices(range(len(weights)), weights)[0])
    return picked


def _write(path, steps, experts=32, top_k=8, coeff=1e-3, layers=("1", "2"), rank=0):
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "run", "rank": rank, "world_size": 2, "ep": 1, "tokens_per_step": 64,
                            "recipe": "synthetic", "flavor": "x", "layers": list(layers), "num_experts": experts,
                            "top_k": top_k, "load_balance_coeff": coeff}) + "\n")
        for step, counts in steps.items():
            f.write(json.dumps({"kind": "step", "step": step, "counts": counts}) + "\n")


def _by_hand(counts, ranks):
    block = len(counts) // ranks
    loads = [sum(counts[r * block:(r + 1) * block]) for r in range(ranks)]
    return max(loads) / (sum(loads) / ranks)


@pytest.fixture
def logs(tmp_path):
    rng = random.Random(0)
    files, per_rank = [], []
    for rank in range(2):
        steps = {s: [_counts(32, 8, 64, rng, hot={0, 1, 5}), _counts(32, 8, 64, rng, hot={20})] for s in range(1, 11)}
        _write(tmp_path / f"rank{rank}.jsonl", steps, rank=rank)
        files.append(tmp_path / f"rank{rank}.jsonl")
        per_rank.append(steps)
    return files, per_rank


def test_busiest_rank_over_mean_by_hand(logs):
    files, per_rank = logs
    run, counts = ri.read_counts(files)
    a = ri.analyse(run, counts, skip_steps=2)
    assert a["steps"] == {"first": 3, "last": 10, "count": 8, "skipped_up_to": 2}
    assert a["tokens_per_step"] == 128  # both ranks' 64
    for ep in (8, 32):
        e = a["ep"][str(ep)]
        assert e["derivable"] and e["ranks"] == ep and e["measured_experts_per_rank"] == 32 // ep
        for li, layer in enumerate(("1", "2")):
            ratios = [_by_hand([x + y for x, y in zip(per_rank[0][s][li], per_rank[1][s][li])], ep) for s in range(3, 11)]
            d = e["per_layer"][layer]
            assert d["median"] == pytest.approx(statistics.median(ratios))
            assert d["max"] == pytest.approx(max(ratios))
            assert d["p90"] == pytest.approx(sorted(ratios)[int(0.9 * len(ratios))])
        floor = e["uniform_routing_floor"]["median"]
        assert 1.0 < floor < e["all_layers"]["median"]  # hot experts: above what noise alone gives
    assert a["ep"]["8"]["per_layer"]["1"]["median"] > a["ep"]["8"]["per_layer"]["2"]["median"]  # 3 hot vs 1
    e64 = a["ep"]["64"]
    assert not e64["derivable"] and e64["measured_experts_per_rank"] == 0.5
    assert e64["lower_bound_from_ep"] == 32 and e64["lower_bound"] == a["ep"]["32"]["all_layers"]


def test_a_flagship_sized_log_derives_every_ep(tmp_path):
    rng = random.Random(1)
    steps = {s: [_counts(256, 8, 40, rng)] for s in range(1, 4)}
    _write(tmp_path / "r.jsonl", steps, experts=256, layers=("3",))
    a = ri.analyse(*ri.read_counts([tmp_path / "r.jsonl"]))
    assert all(a["ep"][str(ep)]["derivable"] for ep in (8, 32, 64))
    assert a["ep"]["64"]["measured_experts_per_rank"] == 4


def test_refusals_and_requeued_steps(tmp_path, logs):
    files, per_rank = logs
    _write(tmp_path / "off.jsonl", {1: per_rank[0][1]}, coeff=None)
    with pytest.raises(ValueError, match="aux-loss-free bias"):
        ri.analyse(*ri.read_counts([tmp_path / "off.jsonl"]))
    assert ri.analyse(*ri.read_counts([tmp_path / "off.jsonl"]), allow_unbalanced=True)["steps"]["count"] == 1
    _write(tmp_path / "other.jsonl", {1: [per_rank[0][1][0]]}, layers=("1",))
    with pytest.raises(ValueError, match="different runs"):
        ri.read_counts([files[0], tmp_path / "other.jsonl"])
    _write(tmp_path / "short.jsonl", {1: per_rank[0][1]}, rank=1)
    with pytest.raises(ValueError, match="not in every file"):
        ri.read_counts([files[0], tmp_path / "short.jsonl"])
    requeued = tmp_path / "requeued.jsonl"
    requeued.write_text(files[0].read_text() + json.dumps({"kind": "step", "step": 10, "counts": per_rank[0][3]}) + "\n")
    _, counts = ri.read_counts([requeued])
    assert counts[10][0].tolist() == per_rank[0][3][0]  # the step's last line wins


def test_cli_writes_json_and_markdown(tmp_path, logs):
    files, _ = logs
    out = tmp_path / "out"
    assert ri.main([*map(str, files), "--out", str(out), "--skip-steps", "1"]) == 0
    doc = json.loads((out / "routing_imbalance.json").read_text())
    assert doc["schema"] == ri.SCHEMA and doc["run"]["load_balance_coeff"] == 1e-3
    assert "same share of the experts" in doc["mapping"]
    md = (out / "routing_imbalance.md").read_text()
    assert "| 8 (32) | 4 |" in md and "| 64 (4) | 0.5 | all | not derivable" in md
    assert ri.main([str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 1
