"""moe_comm.predict.documents: the packing matches a token-by-token rebuild of TorchTitan's loader
and TorchTitan's own mask builders; the pairs it counts are the pairs the block-causal mask keeps;
the stated c4 figures and the measured distributions load; a staged dataset is measured as
TorchTitan's loader tokenises it."""

import json
import random

import pytest
import torch

from moe_comm.predict import documents

REPO = documents.REPO


def _stream_pieces(lengths, sequences, seq_len):
    """Independent rebuild: the token stream as (document, is_eos) per token, cut into windows
    of seq_len + 1 whose first seq_len are the input; pieces split after every EOS."""
    stream = [(i, t == n - 1) for i, n in enumerate(lengths) for t in range(n)]
    out = []
    for w in range(documents.BURN_IN_WINDOWS + sequences):
        window = stream[w * (seq_len + 1):(w + 1) * (seq_len + 1)]
        assert len(window) == seq_len + 1
        pieces, run = [], 0
        for doc, eos in window[:seq_len]:
            run += 1
            if eos:
                pieces.append((run, True))
                run = 0
        if run:
            pieces.append((run, False))
        out.append(pieces)
    return out[documents.BURN_IN_WINDOWS:]


@pytest.mark.parametrize("seed", range(6))
def test_pack_is_torchtitans_packing(seed):
    rng = random.Random(seed)
    seq_len = rng.choice([16, 33, 64])
    lengths = [rng.choice([2, 3, 7, 16, 17, 31, 64, 65, 100]) for _ in range(200)]
    got = documents.pack(lengths, 3, seq_len)
    assert got == _stream_pieces(lengths, 3, seq_len)
    assert all(sum(d for d, _ in p) == seq_len for p in got)


def test_pack_raises_when_the_documents_run_out():
    with pytest.raises(ValueError, match="windows"):
        documents.pack([10, 10], 1, 64)


def test_pieces_are_what_torchtitans_masks_see():
    """The token batch cut by TorchTitan's varlen metadata and document mask gives the same pieces,
    and the pairs its block-causal mask keeps are kept_pairs."""
    from torchtitan.models.attention import create_varlen_metadata_for_document, get_document_mask_mod

    seq_len, eos = 96, 1
    pieces = documents.packed(documents.DocumentLengths("short", "test", lengths=(3, 9, 20, 40)), 2, seq_len, seed=3)
    batch = documents.token_batch(pieces, eos_id=eos, filler_id=5)
    assert batch.shape == (2, seq_len)
    meta = create_varlen_metadata_for_document(batch, eos)
    cu = meta.cu_seq_q.tolist()
    flat = [d for p in pieces for d, _ in p]
    assert [b - a for a, b in zip(cu, cu[1:])] == flat
    assert meta.max_q == max(flat)
    doc_mask = get_document_mask_mod(batch.clone(), eos)
    q = torch.arange(seq_len).view(-1, 1)
    k = torch.arange(seq_len).view(1, -1)
    for b, p in enumerate(pieces):
        kept = ((q >= k) & doc_mask(torch.tensor(b), torch.tensor(0), q, k)).sum().item()
        assert kept == documents.kept_pairs(p)


def test_stated_c4_and_its_draws():
    c4 = documents.C4_EN
    assert c4.mean == pytest.approx(156e9 / 365e6 + 2)
    assert "arXiv:2104.08758" in c4.source and "assumption" in c4.source
    draws = c4.draw(200000, random.Random(0))
    assert sum(draws) / len(draws) == pytest.approx(c4.mean, rel=0.03)
    assert min(draws) >= 2
    s = c4.summary()
    assert s["median"] < s["mean"] < s["p90"]  # right-skewed


def test_measured_distributions_load_and_recipes_find_theirs():
    measured = documents.load_measured()
    real = measured["nltk_en"]
    assert len(real.lengths) == 6325  # every document assets/make_real.py stages
    assert min(real.lengths) >= 2 and "tokenizer.json" in real.source
    assert documents.for_recipe("c4_test", "./assets/real/nltk_en", measured) is real
    assert documents.for_recipe("c4", "/data/c4", measured) is documents.C4_EN
    assert documents.for_recipe("c4", None, measured) is documents.C4_EN
    with pytest.raises(KeyError, match="no document lengths measured"):
        documents.for_recipe("c4_test", "./somewhere/else", measured)


def test_measure_tokenises_as_torchtitans_loader(tmp_path):
    from tokenizers import Tokenizer

    texts = ["The small cat sees the dog.", "A bird.", "The quiet river crosses the busy city slowly near the hill."]
    folder = tmp_path / "mini"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    dist = documents.measure(folder, REPO / "assets" / "tiny", "mini")
    tok = Tokenizer.from_file(str(REPO / "assets" / "tiny" / "tokenizer.json"))
    assert list(dist.lengths) == sorted(len(tok.encode(t).ids) + 2 for t in texts)
    out = tmp_path / "lengths.json"
    documents.save_measured([dist], "cmd", out)
    assert documents.load_measured(out)["mini"].lengths == dist.lengths
    with pytest.raises(ValueError, match="either measured lengths or a lognormal"):
        documents.DocumentLengths("bad", "x")


def test_pairs_per_sequence():
    fixed = documents.DocumentLengths("fixed", "test", lengths=(512,))
    # every window of 4097 stream tokens starts somewhere in a 512-token document: pieces of 512
    # and the two ends; their pairs lie between 8 whole documents' and one fewer plus the ends
    pairs = documents.pairs_per_sequence(fixed, 4096)
    assert 7 * 512 * 513 / 2 < pairs <= 8 * 512 * 513 / 2
    c4 = documents.pairs_per_sequence(documents.C4_EN, 4096)
    assert c4 < 4096 * 4097 / 2 / 4  # far below one causal document
    assert c4 == documents.pairs_per_sequence(documents.C4_EN, 4096)  # fixed seed
