"""Stage real English text and a tokenizer for offline training runs (the one-GPU loss curves).

    python assets/make_real.py --nltk-data PATH     # writes assets/real/ (about 8 MB, ignored by git)
    python assets/make_real.py --check              # verify what is there against the manifest

What and why. A loss curve that says something about FP8 dispatch needs text a model can keep
learning from for hundreds of steps; assets/tiny's grammar is learnt in a few dozen. c4 (what
the GPU recipes name) lives on the Hugging Face hub, which the machines that build and run this
could not reach, and no public copy of c4 small enough to stage was found. So this stages other
real, human-written English: five corpora of the NLTK data collection (github.com/nltk/nltk_data,
pinned below by commit and by the SHA-256 of each zip):

| corpus | what | words |
| --- | --- | --- |
| abc | Australian Broadcasting Commission 2006 rural and science news | 0.77M |
| movie_reviews | Pang & Lee polarity v2.0: 2,000 film reviews (lowercased, tokenised as published) | 1.49M |
| state_union | US State of the Union addresses 1945-2006 | 0.40M |
| inaugural | US presidential inaugural addresses 1789-2009 | 0.15M |
| webtext | Firefox support forum, Overheard in New York, wine diary, personal ads, two film scripts | 0.30M |

PATH is a clone of nltk_data (its git directory or work tree; the zips are read at the pinned
commit) or a folder holding the five zips (e.g. NLTK's own download folder `~/nltk_data/corpora`).

Documents: a file of inaugural, state_union and movie_reviews is one document; abc is cut into
stories at its headline lines (a line that does not end like a sentence); a webtext file, a run
of independent posts or script lines, is cut at line ends into documents of about 1,000 words.
The documents are shuffled (seed 0) so that every stretch of training mixes the genres, and
written as c4's schema, one {"text": ...} per line, to assets/real/nltk_en/train.jsonl.gz: the
offline format TorchTitan's "c4_test" loader reads through `[training] dataset_path`
(`load_dataset(folder, split="train")`; the split comes from the file name).

Tokenizer: a byte-level BPE of 32,768 entries trained on those documents (the DeepSeek-V3
tokenizer is on the hub too), saved with the same tokenizer_config.json as assets/tiny, into
assets/real/. Models whose vocab_size is larger (DeepSeek-V3 shapes: 129,280) just never see
the upper ids; TorchTitan's `debugmodel` (vocab 2,048) cannot take it.

Reproducible: the source zips are checked against their pinned SHA-256 before anything is
written, and assets/real/MANIFEST.json records the SHA-256 of the uncompressed JSONL (pinned
here, pure Python, so any machine must reproduce it) and of tokenizer.json with the `tokenizers`
version that trained it (`--check` compares it when the installed version is the same).
"""

import argparse
import gzip
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent / "real"
DATASET_DIR = "nltk_en"
DATASET_FILE = "train.jsonl.gz"

NLTK_DATA_COMMIT = "5db857e6f7df11eabb5e5665836db9ec8df07e28"  # nltk/nltk_data, 2023-02-02
# packages/corpora/<name>.zip at that commit
SOURCES = {
    "abc": "129bb6001beb828049a90a59b7dd3c2f0594a47012e48fc5177dfae38e658565",
    "movie_reviews": "a41211ae685019137410268134db6a1a14428c89b671eb83056151a878539008",
    "state_union": "366c1dc82b2abf896f42b2ec50ba802a0141a29f75d29ca48a7a243ce5bfbe8d",
    "inaugural": "7c5fb5793e31fbeae12bf1aa0ffda5336468f07cedb50654c6d31ca384e2046b",
    "webtext": "9e32dbae4879464b8f420a0dc721855bb26167b720d7695588d2ca2aeadf501a",
}
# SHA-256 of the uncompressed JSONL these sources and this script's document rules make (the first
# build, 2026-12-01); every build and --check compares with it.
JSONL_SHA256 = "ffe9ac45373f31a9562c8fbb7ff7807673809793f70cb9998d4140e431fc0e00"

VOCAB_SIZE = 32768
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SHUFFLE_SEED = 0
WEBTEXT_DOC_WORDS = 1000


class SourceError(Exception):
    """A source zip that is missing or not the pinned one, with where it was looked for."""


def read_zip_bytes(nltk_data: Path, name: str) -> bytes:
    """The bytes of corpus `name`'s zip from a clone of nltk_data (git dir or work tree, read at
    the pinned commit) or from a folder of zips, checked against its pinned SHA-256."""
    candidates = [nltk_data / f"{name}.zip", nltk_data / "packages" / "corpora" / f"{name}.zip"]
    data = next((p.read_bytes() for p in candidates if p.is_file()), None)
    if data is None:
        git_dir = nltk_data / ".git" if (nltk_data / ".git").exists() else nltk_data
        show = subprocess.run(
            ["git", "--git-dir", str(git_dir), "show", f"{NLTK_DATA_COMMIT}:packages/corpora/{name}.zip"],
            capture_output=True,
        )
        if show.returncode != 0:
            raise SourceError(
                f"{name}.zip: not in {nltk_data} (as {name}.zip or packages/corpora/{name}.zip), and not "
                f"readable from it as a git repository at commit {NLTK_DATA_COMMIT} "
                f"({show.stderr.decode(errors='replace').strip()}); clone github.com/nltk/nltk_data or "
                f"give the folder NLTK downloads its corpora to"
            )
        data = show.stdout
    digest = hashlib.sha256(data).hexdigest()
    if digest != SOURCES[name]:
        raise SourceError(f"{name}.zip has SHA-256 {digest}, not the pinned {SOURCES[name]}: another "
                          f"version of the corpus; use nltk_data at commit {NLTK_DATA_COMMIT}")
    return data


def decode(raw: bytes) -> str:
    """UTF-8, or Latin-1 for the few webtext files that are not; line ends made \\n."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x85", "\n")


def corpus_files(zip_bytes: bytes) -> list[tuple[str, str]]:
    """(name, text) of every text file in a corpus zip, sorted by name, READMEs left out."""
    with zipfile.ZipFile(io.BytesIO(zip_bytes)) as z:
        names = sorted(n for n in z.namelist() if not n.endswith("/") and Path(n).name != "README")
        return [(n, decode(z.read(n))) for n in names]


_SENTENCE_END = re.compile(r"""[.!?:;"')\]]$""")


def split_stories(text: str) -> list[str]:
    """abc's news files: a story is its headline (a line that does not end like a sentence) and
    the lines up to the next headline."""
    stories: list[list[str]] = []
    for line in (raw.strip() for raw in text.split("\n")):
        if not line:
            continue
        if not stories or (not _SENTENCE_END.search(line) and len(stories[-1]) > 1):
            stories.append([line])
        else:
            stories[-1].append(line)
    return ["\n".join(s) for s in stories]


def split_lines(text: str, words: int = WEBTEXT_DOC_WORDS) -> list[str]:
    """Runs of whole lines of about `words` words each (the last one may be shorter)."""
    docs, current, count = [], [], 0
    for line in (raw.rstrip() for raw in text.split("\n")):
        if not line:
            continue
        current.append(line)
        count += len(line.split())
        if count >= words:
            docs.append("\n".join(current))
            current, count = [], 0
    if current:
        docs.append("\n".join(current))
    return docs


def documents(corpus: str, files: list[tuple[str, str]]) -> list[str]:
    docs = []
    for _, text in files:
        if corpus == "abc":
            docs += split_stories(text)
        elif corpus == "webtext":
            docs += split_lines(text)
        else:
            doc = text.strip()
            if doc:
                docs.append(doc)
    return docs


def build_documents(nltk_data: Path) -> dict[str, list[str]]:
    return {name: documents(name, corpus_files(read_zip_bytes(nltk_data, name))) for name in SOURCES}


def shuffled(by_corpus: dict[str, list[str]], seed: int = SHUFFLE_SEED) -> list[str]:
    docs = [doc for name in SOURCES for doc in by_corpus[name]]
    random.Random(seed).shuffle(docs)
    return docs


def jsonl_bytes(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")


def write_dataset(folder: Path, docs: list[str]) -> str:
    """train.jsonl.gz in `folder` (gzip without a timestamp, so the same text gives the same file);
    returns the SHA-256 of the uncompressed JSONL."""
    data = jsonl_bytes(docs)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / DATASET_FILE, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
            gz.write(data)
    return hashlib.sha256(data).hexdigest()


def train_tokenizer(docs: list[str], out: Path, vocab_size: int = VOCAB_SIZE) -> str:
    """A byte-level BPE on `docs`, saved as tokenizer.json + tokenizer_config.json (the files
    TorchTitan's HuggingFaceTokenizer reads); returns the SHA-256 of tokenizer.json."""
    from tokenizers import decoders, models, pre_tokenizers, trainers, Tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False}, f, indent=2)
    return hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()


def count_tokens(docs: list[str], out: Path) -> int:
    """Tokens TorchTitan's loader makes of `docs`: each document's ids plus its BOS and EOS."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    return sum(len(e.ids) + 2 for e in tokenizer.encode_batch(docs))


def tokenizers_version() -> str:
    import tokenizers

    return tokenizers.__version__


def build(nltk_data: Path, out: Path = OUT) -> dict:
    by_corpus = build_documents(nltk_data)
    docs = shuffled(by_corpus)
    jsonl_sha = write_dataset(out / DATASET_DIR, docs)
    if jsonl_sha != JSONL_SHA256:
        raise SourceError(f"the JSONL came out with SHA-256 {jsonl_sha}, not the pinned {JSONL_SHA256}: "
                          "this script's document rules changed (pin the new value if that was meant)")
    tokenizer_sha = train_tokenizer(docs, out)
    manifest = {
        "source": f"github.com/nltk/nltk_data@{NLTK_DATA_COMMIT} packages/corpora/*.zip",
        "sources_sha256": SOURCES,
        "documents": {name: len(d) for name, d in by_corpus.items()},
        "words": sum(len(d.split()) for d in docs),
        "tokens": count_tokens(docs, out),
        "shuffle_seed": SHUFFLE_SEED,
        "dataset": f"{DATASET_DIR}/{DATASET_FILE}",
        "dataset_bytes": (out / DATASET_DIR / DATASET_FILE).stat().st_size,
        "jsonl_sha256": jsonl_sha,
        "tokenizer_vocab_size": VOCAB_SIZE,
        "tokenizer_sha256": tokenizer_sha,
        "tokenizers_version": tokenizers_version(),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check(out: Path = OUT) -> list[str]:
    """What does not match the manifest (empty: everything does)."""
    manifest_path = out / "MANIFEST.json"
    if not manifest_path.is_file():
        return [f"{manifest_path} is missing: build it with python assets/make_real.py --nltk-data PATH"]
    manifest = json.loads(manifest_path.read_text())
    problems = []
    dataset = out / manifest["dataset"]
    if not dataset.is_file():
        problems.append(f"{dataset} is missing")
    else:
        digest = hashlib.sha256(gzip.decompress(dataset.read_bytes())).hexdigest()
        if digest != manifest["jsonl_sha256"]:
            problems.append(f"{dataset}: its JSONL has SHA-256 {digest}, the manifest says {manifest['jsonl_sha256']}")
        if digest != JSONL_SHA256:
            problems.append(f"{dataset}: its JSONL has SHA-256 {digest}, this script pins {JSONL_SHA256}")
    tokenizer = out / "tokenizer.json"
    if not tokenizer.is_file() or not (out / "tokenizer_config.json").is_file():
        problems.append(f"{out}: tokenizer.json or tokenizer_config.json is missing")
    elif tokenizers_version() == manifest["tokenizers_version"]:
        digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
        if digest != manifest["tokenizer_sha256"]:
            problems.append(f"{tokenizer} has SHA-256 {digest}, the manifest says {manifest['tokenizer_sha256']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nltk-data", type=Path, help="a clone of github.com/nltk/nltk_data, or a folder of its corpus zips")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="build nothing: compare --out with its manifest")
    args = p.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(f"make_real: {problem}")
        print("make_real: ok" if not problems else "make_real: does not match")
        return 1 if problems else 0
    if args.nltk_data is None:
        p.error("give --nltk-data PATH (a clone of github.com/nltk/nltk_data, or a folder of its corpus zips)")
    try:
        manifest = build(args.nltk_data, args.out)
    except SourceError as e:
        print(f"make_real: {e}", file=sys.stderr)
        return 1
    print(f"make_real: wrote {args.out}: {sum(manifest['documents'].values())} documents, {manifest['words']:,} words, "
          f"{manifest['tokens']:,} tokens, {manifest['dataset']} {manifest['dataset_bytes'] / 1e6:.1f} MB, "
          f"JSONL SHA-256 {manifest['jsonl_sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
