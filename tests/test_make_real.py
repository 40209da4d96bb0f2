"""assets/make_real.py on small stand-in corpora (the real zips are not in the repository): a
source that is not the pinned one is refused before anything is written; the document rules;
the same documents give the same bytes; TorchTitan's own "c4_test" loader reads the staged
folder with the trained tokenizer; --check notices a changed file."""

import gzip
import hashlib
import io
import json
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "assets"))

import make_real  # noqa: E402


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_a_source_that_is_not_the_pinned_one_is_refused(tmp_path):
    (tmp_path / "abc.zip").write_bytes(_zip({"abc/rural.txt": b"Headline\nBody.\n"}))
    with pytest.raises(make_real.SourceError) as e:
        make_real.read_zip_bytes(tmp_path, "abc")
    assert "abc.zip has SHA-256" in str(e.value) and make_real.SOURCES["abc"] in str(e.value)
    assert make_real.NLTK_DATA_COMMIT in str(e.value)
    with pytest.raises(make_real.SourceError, match="clone github.com/nltk/nltk_data"):
        make_real.read_zip_bytes(tmp_path, "webtext")  # not there at all


def test_a_folder_of_zips_with_the_pinned_digest_is_read(tmp_path, monkeypatch):
    data = _zip({"inaugural/README": b"about", "inaugural/1789-Washington.txt": b"Fellow-Citizens.\r\n",
                 "inaugural/1793-Washington.txt": "Caf\xe9 society.\n".encode("latin-1")})
    (tmp_path / "inaugural.zip").write_bytes(data)
    monkeypatch.setitem(make_real.SOURCES, "inaugural", hashlib.sha256(data).hexdigest())
    files = make_real.corpus_files(make_real.read_zip_bytes(tmp_path, "inaugural"))
    assert files == [("inaugural/1789-Washington.txt", "Fellow-Citizens.\n"),
                     ("inaugural/1793-Washington.txt", "Caf\xe9 society.\n")]  # README out, Latin-1 decoded
    assert make_real.documents("inaugural", files) == ["Fellow-Citizens.", "Caf\xe9 society."]


def test_abc_is_cut_into_stories_at_headlines():
    text = ("Drought hits growers\nGrowers say the drought is the worst in decades.\n"
            "The minister says help is coming.\n\nRain brings relief\nFarmers welcomed rain on Monday.\n"
            "\"It is a start,\" one said.\n")
    assert make_real.split_stories(text) == [
        "Drought hits growers\nGrowers say the drought is the worst in decades.\nThe minister says help is coming.",
        "Rain brings relief\nFarmers welcomed rain on Monday.\n\"It is a start,\" one said.",
    ]


def test_webtext_is_cut_at_line_ends_into_runs_of_about_n_words():
    lines = [f"post {i} has five words" for i in range(10)]
    docs = make_real.split_lines("\n".join(lines), words=12)
    assert docs == ["\n".join(lines[i:i + 3]) for i in (0, 3, 6)] + [lines[9]]


def test_same_documents_same_bytes_and_titans_loader_reads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    docs = make_real.shuffled({name: [f"{name} document {i}. It has real words in it." for i in range(30)]
                               for name in make_real.SOURCES})
    assert docs != sorted(docs) and len(set(docs)) == 150
    sha = make_real.write_dataset(tmp_path / "a" / make_real.DATASET_DIR, docs)
    make_real.write_dataset(tmp_path / "b" / make_real.DATASET_DIR, docs)
    a, b = (tmp_path / x / make_real.DATASET_DIR / make_real.DATASET_FILE for x in "ab")
    assert a.read_bytes() == b.read_bytes()  # no timestamp in the gzip header
    assert hashlib.sha256(gzip.decompress(a.read_bytes())).hexdigest() == sha
    make_real.train_tokenizer(docs, tmp_path / "a", vocab_size=400)

    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    tokenizer = HuggingFaceTokenizer(str(tmp_path / "a"))
    assert 258 < tokenizer.get_vocab_size() <= 400 and tokenizer.bos_id is not None and tokenizer.eos_id is not None
    ds = HuggingFaceTextDataset("c4_test", str(a.parent), tokenizer, seq_len=64, infinite=False)
    windows = list(ds)
    assert len(ds._data) == 150
    total = make_real.count_tokens(docs, tmp_path / "a")
    assert len(windows) == total // 65  # every token read once, in windows of seq_len + 1
    first_input, _ = windows[0]
    assert first_input["input"][0].item() == tokenizer.bos_id
    assert tokenizer.decode(first_input["input"][1:12].tolist()).startswith(docs[0][:10])


def test_check_notices_a_changed_dataset(tmp_path, monkeypatch):
    docs = ["one real sentence.", "another real sentence."]
    sha = make_real.write_dataset(tmp_path / make_real.DATASET_DIR, docs)
    monkeypatch.setattr(make_real, "JSONL_SHA256", sha)
    tok_sha = make_real.train_tokenizer(docs * 20, tmp_path, vocab_size=300)
    manifest = {"dataset": f"{make_real.DATASET_DIR}/{make_real.DATASET_FILE}", "jsonl_sha256": sha,
                "tokenizer_sha256": tok_sha, "tokenizers_version": make_real.tokenizers_version()}
    (tmp_path / "MANIFEST.json").write_text(json.dumps(manifest))
    assert make_real.check(tmp_path) == []
    make_real.write_dataset(tmp_path / make_real.DATASET_DIR, docs[:1])
    problems = make_real.check(tmp_path)
    assert any("the manifest says" in p for p in problems) and any("this script pins" in p for p in problems)
    assert make_real.check(tmp_path / "nothing") == [
        f"{tmp_path / 'nothing' / 'MANIFEST.json'} is missing: build it with python assets/make_real.py --nltk-data PATH"]
