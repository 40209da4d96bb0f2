"""Document lengths of a recipe's dataset, and how TorchTitan packs them into sequences.

Block-causal attention (TorchTitan's `attn_mask_type = "block_causal"`) attends within a
document only, so its cost per sequence follows the lengths of the document pieces each packed
sequence holds, not the sequence length. The layer benchmark (experiments/layer_bench.py) draws
sequences from a recipe's distribution here and measures attention at them; the scale model
prices attention by the (query, key) pairs those pieces keep (`kept_pairs`).

A length counts what TorchTitan's loader feeds the model per document: its token ids plus BOS
and EOS (`HuggingFaceTextDataset` encodes each text with add_bos and add_eos). Where a
recipe's data is staged, the distribution is every document of it, tokenised with the recipe's
tokenizer (`measure`, written to results/model_inputs/document_lengths.json with the command that made it).
Where it is not (c4 for the flagship and the Nebius anchors), it is stated with its source:
`C4_EN`. `for_recipe` picks one.

Packing (`pack`) is TorchTitan's: the documents form one stream, cut into windows of seq_len + 1
tokens whose first seq_len are a sequence's input; a piece ends at its document's EOS or at the
window's end (a document that runs on starts the next window). The masks then see exactly these
pieces: `get_document_mask_mod` and `create_varlen_metadata_for_document` both cut at EOS and
at the sequence's end.
"""

import argparse
import datetime
import gzip
import json
import math
import random
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moe_comm.predict.assumptions import MODEL_INPUTS, REPO

MEASURED = MODEL_INPUTS / "document_lengths.json"
SCHEMA = "document_lengths/1"
# Windows drawn and dropped before the sequences kept, so the first kept window starts inside a
# document (as almost every window of a long run does), not at the stream's first BOS.
BURN_IN_WINDOWS = 2


@dataclass(frozen=True)
class DocumentLengths:
    """A distribution of document lengths in tokens (each document's ids + BOS + EOS): either
    every document of a staged dataset (`lengths`), or a stated lognormal (`lognormal` = mean
    tokens and the standard deviation of the log) where the data is not staged."""

    name: str
    source: str
    lengths: tuple[int, ...] = ()
    lognormal: tuple[float, float] | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if bool(self.lengths) == (self.lognormal is not None):
            raise ValueError(f"document lengths {self.name!r}: give either measured lengths or a lognormal, not both")
        if self.lengths and min(self.lengths) < 2:
            raise ValueError(f"document lengths {self.name!r}: a document has at least its BOS and EOS (2 tokens)")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.lengths) if self.lengths else self.lognormal[0]

    def draw(self, n: int, rng: random.Random) -> list[int]:
        """n document lengths: measured documents drawn with replacement, or lognormal draws
        (rounded, at least 2 tokens)."""
        if self.lengths:
            return [rng.choice(self.lengths) for _ in range(n)]
        mean, sigma = self.lognormal
        mu = math.log(mean) - sigma * sigma / 2  # a lognormal's mean is exp(mu + sigma^2 / 2)
        return [max(2, round(rng.lognormvariate(mu, sigma))) for _ in range(n)]

    def summary(self) -> dict:
        """Mean, quantiles and source, for reports."""
        sample = sorted(self.lengths) if self.lengths else sorted(self.draw(20000, random.Random(0)))
        q = lambda p: sample[min(len(sample) - 1, int(p * len(sample)))]  # noqa: E731
        return {"name": self.name, "source": self.source, "documents": len(self.lengths) or None,
                "mean": self.mean, "median": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": sample[-1],
                "lognormal": list(self.lognormal) if self.lognormal else None, "notes": list(self.notes)}


# c4 "en" (allenai/c4), what the flagship recipe streams and the Nebius anchors trained on; not
# staged here, so stated. The mean is the published figure; the shape is not published and is an
# assumption (the layer benchmark also measures the staged real text's lengths and fixed 512-token
# documents beside it, and the scale model prices any distribution by the pairs it keeps).
C4_EN_DOCUMENTS = 365e6
C4_EN_TOKENS = 156e9
C4_EN_SIGMA = 1.0
C4_EN = DocumentLengths(
    name="c4_en",
    source=("mean: C4 (en) 365M documents and 156B tokens, as Dodge et al. 2021, 'Documenting Large Webtext Corpora: "
            "A Case Study on the Colossal Clean Crawled Corpus' (EMNLP 2021, arXiv:2104.08758), report them (read "
            "here through a secondary page quoting the same two figures, aiwiki.ai's C4 article; check Table 1), so "
            "427.4 tokens per document, + BOS and EOS; shape: lognormal with sigma 1.0 (an assumption: no published "
            "distribution)"),
    lognormal=(C4_EN_TOKENS / C4_EN_DOCUMENTS + 2, C4_EN_SIGMA),
    notes=("the paper's tokens are not DeepSeek-V3's tokenizer's; allenai/c4's dataset card (config en, train "
           "split: 364,868,892 documents in 828,589,180,707 bytes, text with url and timestamp, 2,271 bytes a "
           "record) gives 450-570 tokens a document at 4-5 bytes a token, so the mean may be up to a third higher",
           "sigma is not published: at sigma 1.0 a document's expected squared length is e times its mean's "
           "square, which is what block-causal attention's work follows"),
)


# ---- packing ---------------------------------------------------------------------------------

def pack(lengths: list[int], sequences: int, seq_len: int) -> list[list[tuple[int, bool]]]:
    """TorchTitan's packing of a document stream into `sequences` inputs of `seq_len` tokens
    (after BURN_IN_WINDOWS dropped windows): per sequence, its pieces as (tokens, ends_with_eos).
    Each window holds seq_len + 1 stream tokens; its last is only a label, so a piece that runs
    into it loses that token. Raises if `lengths` run out before the last window fills."""
    window = seq_len + 1
    out, current, filled = [], [], 0
    for n in lengths:
        left = n
        while left:
            take = min(left, window - filled)
            left -= take
            filled += take
            input_part = take - (1 if filled == window else 0)  # the window's last token is a label
            if input_part:
                current.append((input_part, left == 0 and filled < window))
            if filled == window:
                out.append(current)
                current, filled = [], 0
                if len(out) == BURN_IN_WINDOWS + sequences:
                    return out[BURN_IN_WINDOWS:]
    raise ValueError(f"{len(lengths)} documents fill {len(out)} windows of {window} tokens; "
                     f"{BURN_IN_WINDOWS + sequences} are needed")


def packed(dist: DocumentLengths, sequences: int, seq_len: int, seed: int = 0) -> list[list[tuple[int, bool]]]:
    """`sequences` packed inputs of `seq_len` tokens drawn from `dist` with a fixed seed."""
    rng = random.Random(seed)
    lengths: list[int] = []
    need = (BURN_IN_WINDOWS + sequences) * (seq_len + 1)
    while sum(lengths) < need:
        lengths += dist.draw(max(16, need // max(1, int(dist.mean))), rng)
    return pack(lengths, sequences, seq_len)


def kept_pairs(pieces: list[tuple[int, bool]]) -> int:
    """(query, key) pairs block-causal attention keeps in one sequence: d (d + 1) / 2 per piece."""
    return sum(d * (d + 1) // 2 for d, _ in pieces)


def pairs_per_sequence(dist: DocumentLengths, seq_len: int, samples: int = 256, seed: int = 0) -> float:
    """The (query, key) pairs block-causal attention keeps in a packed sequence of `seq_len`
    tokens, on average over `samples` sequences drawn with a fixed seed: what attention's work
    follows (one causal document keeps seq_len (seq_len + 1) / 2)."""
    return statistics.fmean(kept_pairs(p) for p in packed(dist, samples, seq_len, seed))


def token_batch(pieces_per_sequence: list[list[tuple[int, bool]]], eos_id: int, filler_id: int):
    """A [sequences, seq_len] int64 token batch with `eos_id` where a document ends and
    `filler_id` elsewhere: the input TorchTitan's mask builders read (they look at EOS only)."""
    import torch

    rows = []
    for pieces in pieces_per_sequence:
        row = []
        for d, eos in pieces:
            row += [filler_id] * (d - 1) + [eos_id if eos else filler_id]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


# ---- measured from staged data ---------------------------------------------------------------

def _texts(dataset_path: Path):
    """The "text" of every record of a staged dataset folder (JSONL, plain or gzipped, as the c4
    loaders read them), in file-name order."""
    files = sorted(p for p in dataset_path.rglob("*") if p.is_file() and (p.name.endswith(".jsonl")
                   or p.name.endswith(".json") or p.name.endswith(".jsonl.gz") or p.name.endswith(".json.gz")))
    if not files:
        raise FileNotFoundError(f"{dataset_path}: no .json/.jsonl(.gz) records to measure")
    for f in files:
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt", encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    yield json.loads(line)["text"]


def measure(dataset_path: Path, tokenizer_path: Path, name: str, max_documents: int = 0) -> DocumentLengths:
    """Every document of a staged dataset (up to `max_documents`, 0 for all), tokenised with the
    recipe's tokenizer.json as TorchTitan's loader tokenises it (+ BOS and EOS)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_path) / "tokenizer.json"))
    texts = []
    for text in _texts(Path(dataset_path)):
        texts.append(text)
        if max_documents and len(texts) == max_documents:
            break
    lengths = tuple(sorted(len(e.ids) + 2 for e in tokenizer.encode_batch(texts)))
    return DocumentLengths(name=name, source=f"measured: every document of {dataset_path} tokenised with "
                           f"{Path(tokenizer_path) / 'tokenizer.json'} (+ BOS and EOS)", lengths=lengths)


def load_measured(path: Path = MEASURED) -> dict[str, DocumentLengths]:
    """The distributions results/model_inputs/document_lengths.json holds, by name."""
    if not Path(path).is_file():
        return {}
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a document_lengths JSON (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
    return {name: DocumentLengths(name=name, source=d["source"], lengths=tuple(d["lengths"]))
            for name, d in doc["datasets"].items()}


def save_measured(dists: list[DocumentLengths], command: str, path: Path = MEASURED) -> None:
    """Adds (or replaces) distributions in results/model_inputs/document_lengths.json."""
    doc = json.loads(Path(path).read_text()) if Path(path).is_file() else {"schema": SCHEMA, "datasets": {}}
    now = datetime.date.today().isoformat()
    for d in dists:
        doc["datasets"][d.name] = {"source": d.source, "command": command, "date": now,
                                   "summary": {k: v for k, v in d.summary().items() if k not in ("name", "source")},
                                   "lengths": list(d.lengths)}
    text = json.dumps(doc, indent=1)  # lists of numbers on one line each (thousands of lengths)
    text = re.sub(r"\[\n\s*(-?[\d.]+(?:,\n\s*-?[\d.]+)*)\n\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    Path(path).write_text(text + "\n")


def for_recipe(dataset: str, dataset_path: str | None, measured: dict[str, DocumentLengths] | None = None
               ) -> DocumentLengths:
    """A recipe's distribution ([training] dataset and dataset_path): measured where its staged
    folder was measured (by the folder's name, e.g. "nltk_en" for assets/real/nltk_en), the stated
    c4 figures for TorchTitan's "c4" loader otherwise."""
    measured = load_measured() if measured is None else measured
    if dataset_path and Path(dataset_path).name in measured:
        return measured[Path(dataset_path).name]
    if dataset.lower() == "c4":  # TorchTitan's c4 loader: allenai/c4 "en", staged or streamed
        return C4_EN
    raise KeyError(f"[training] dataset = {dataset!r}, dataset_path = {dataset_path!r}: no document lengths "
                   f"measured for it in {MEASURED.relative_to(REPO)}; stage it and run "
                   "`python -m moe_comm.predict.documents measure --dataset-path DIR --tokenizer DIR`")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description="measure a staged dataset's document lengths into "
                                f"{MEASURED.relative_to(REPO)}, or show a distribution")
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--dataset-path", type=Path, required=True)
    m.add_argument("--tokenizer", type=Path, required=True, help="the folder holding tokenizer.json")
    m.add_argument("--name", help="default: the dataset folder's name")
    m.add_argument("--out", type=Path, default=MEASURED)
    s = sub.add_parser("show")
    s.add_argument("name", help=f"c4_en, or a name in {MEASURED.relative_to(REPO)}")
    args = p.parse_args(argv)
    if args.verb == "show":
        dist = C4_EN if args.name == C4_EN.name else load_measured()[args.name]
        print(json.dumps(dist.summary(), indent=1))
        return 0
    dist = measure(args.dataset_path, args.tokenizer, args.name or args.dataset_path.name)
    save_measured([dist], shlex.join(["python", "-m", "moe_comm.predict.documents", *argv]), args.out)
    s = dist.summary()
    print(f"{dist.name}: {s['documents']} documents, mean {s['mean']:.1f} tokens, median {s['median']}, "
          f"p90 {s['p90']}, max {s['max']} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
