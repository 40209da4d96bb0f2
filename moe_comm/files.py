"""What a recipe reads and writes on disk, checked on the machine that asks before any rank
starts: the tokenizer, the first records of a local dataset, the dump folder.

Each problem is a launch blocker: a line that names the field, what is wrong there and the
fix. `train` and `submit` refuse while any remains; `check` prints its whole report first and
lists them after it (a laptop can plan a cluster recipe whose tokenizer and data live on the
cluster). What only looks suspicious (a stand-in tokenizer far smaller than the model's
vocabulary) is a warning instead.

The dataset is read the way TorchTitan 0.2.2's loader reads it (torchtitan/hf_datasets/
text_datasets.py: `load_dataset(path[, name], split="train")`, then `sample["text"]`): the data
files come from Hugging Face datasets' own resolution of the folder (its dataset card, or the
file names), every file of the split must hold something, and every record is parsed while
FULL_READ_BYTES last (a small dataset whole: a bad record deep in it is named with its file and
line), beyond that the first records of each file and the last line of a plain file, where a
truncated copy ends mid-record, with a note of how far the reading went. Before, an empty
folder, an empty or truncated train.jsonl, or records without the text field all started
torchrun and failed inside every rank (an empty file with a bare StopIteration).
"""

import gzip
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# TorchTitan's datasets: the configuration name its loader asks for, and the field it reads.
DATASET_LOADERS = {"c4": ("en", "text"), "c4_validation": ("en", "text"), "c4_test": (None, "text")}
RECORDS_READ = 8  # records of every data file parsed before launch, however large
# Bytes of (decompressed) records read in all before launch, beyond each file's first records:
# a second or so of parsing; a dataset within it is read whole, a larger one up to it (a note)
FULL_READ_BYTES = 64_000_000
TITAN_DEFAULT_ASSETS = "./tests/assets/tokenizer"  # [model] hf_assets_path when a recipe does not set it
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")  # what TorchTitan's tokenizer loads
STAND_IN_RATIO = 10  # a tokenizer this many times smaller than the model's vocabulary is a stand-in


@dataclass
class Findings:
    """What `check` found on disk: launch blockers, warnings, and what it could not check."""

    blockers: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check(config, model_vocab: int, sets_assets_path: bool) -> Findings:
    """Everything on disk the run needs, as launch blockers and warnings (see the module doc)."""
    found = Findings()
    recipe_file = config.job.config_file or "RECIPE.toml"
    _tokenizer(config, model_vocab, sets_assets_path, recipe_file, found)
    _dataset(config, recipe_file, found)
    problem = dump_folder_problem(config.job.dump_folder)
    if problem:
        found.blockers.append(f"[job] dump_folder = {config.job.dump_folder!r} {problem}")
    return found


# ---- tokenizer --------------------------------------------------------------------------------

def _fetch_hint(config, recipe_file: str, what: str) -> str:
    """How to put the tokenizer or dataset in place: the assets verb when [assets] names a hub
    repo for it, else by hand (the verb alone would fail on the empty repo)."""
    repo = config.assets.tokenizer_repo if what == "tokenizer" else config.assets.dataset_repo
    key = "tokenizer_repo" if what == "tokenizer" else "dataset_repo"
    if repo:
        return f"`python -m moe_comm assets {recipe_file}` fetches it from {repo}"
    return (f"put the files there, or name their hub repo in [assets] {key} and run "
            f"`python -m moe_comm assets {recipe_file}`")


def _relative(path: str) -> str:
    return "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"


def _or_absolute(path: str, what: str) -> str:
    return "" if os.path.isabs(path) else f", or run from the repository root, or give an absolute path {what}"


def _tokenizer(config, model_vocab: int, sets_path: bool, recipe_file: str, found: Findings) -> None:
    assets = config.model.hf_assets_path
    if not sets_path:
        found.blockers.append(
            f"[model] hf_assets_path is not set, so TorchTitan reads its own default {TITAN_DEFAULT_ASSETS!r}, "
            "which is a folder of TorchTitan's source tree, not of this repository: set it to a folder "
            "with a Hugging Face tokenizer (tokenizer.json), e.g. \"./assets/tiny\" for the offline one"
        )
        return
    if not os.path.isdir(assets):
        found.blockers.append(
            f"[model] hf_assets_path = {assets!r} is not a directory{_relative(assets)}: "
            f"{_fetch_hint(config, recipe_file, 'tokenizer')}{_or_absolute(assets, 'to the tokenizer folder')}"
        )
        return
    if not any(os.path.isfile(os.path.join(assets, f)) for f in TOKENIZER_FILES):
        found.blockers.append(
            f"[model] hf_assets_path = {assets!r} has no tokenizer.json (or vocab.json/vocab.txt): "
            f"{_fetch_hint(config, recipe_file, 'tokenizer')}, or point it at a Hugging Face tokenizer "
            "folder (for the tiny one: python assets/make_tiny.py)"
        )
        return
    size = tokenizer_vocab_size(assets)
    if size is None:
        found.notes.append(f"the vocabulary of the tokenizer in {assets} was not read (no tokenizer.json)")
    elif size > model_vocab:
        found.blockers.append(
            f"[model] hf_assets_path = {assets!r}: its tokenizer makes ids up to {size - 1}, beyond [model] "
            f"flavor = {config.model.flavor!r}'s vocab_size {model_vocab}, which fails in the first embedding "
            "lookup (a device assert on GPU); use a flavor whose vocabulary covers the tokenizer, or a "
            "tokenizer of at most that many entries"
        )
    elif size * STAND_IN_RATIO < model_vocab:
        found.warnings.append(
            f"[model] hf_assets_path = {assets!r} holds a {size:,}-token tokenizer for a model of {model_vocab:,} "
            f"(flavor {config.model.flavor!r}): a stand-in, fine for timing, but its loss says nothing about "
            "the real model; use the model's own tokenizer to train it"
        )


def tokenizer_vocab_size(folder: str) -> int | None:
    """Token ids of the tokenizer.json in `folder` (its vocabulary and added tokens), or None."""
    path = os.path.join(folder, "tokenizer.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    vocab = data.get("model", {}).get("vocab", {})
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # BPE/WordLevel, Unigram
    ids += [t.get("id", -1) for t in data.get("added_tokens", [])]
    return max(ids) + 1 if ids else None


# ---- dataset ----------------------------------------------------------------------------------

def _local(path: str | None) -> bool:
    """A dataset_path starting with . or / is a folder; anything else a hub id (streamed)."""
    return bool(path) and path.startswith((".", "/"))


def dataset_blocker(config, read_bytes: float = float("inf")) -> str:
    """The launch blocker of a local dataset, reading up to `read_bytes` of its records (all of
    them by default: a rank whose loader failed asks which record it was), "" for none."""
    found = Findings()
    _dataset(config, config.job.config_file or "RECIPE.toml", found, read_bytes)
    return found.blockers[0] if found.blockers else ""


def _dataset(config, recipe_file: str, found: Findings, read_bytes: float | None = None) -> None:
    t = config.training
    path = t.dataset_path
    where = f"[training] dataset_path = {path!r}"
    if not _local(path):
        return  # a hub dataset: every rank streams it, nothing on this disk to read
    if not os.path.exists(path):
        found.blockers.append(
            f"{where} does not exist{_relative(path)}: {_fetch_hint(config, recipe_file, 'dataset')}"
            f"{_or_absolute(path, 'to the dataset folder')}"
        )
        return
    if t.dataset not in DATASET_LOADERS:
        found.notes.append(f"{where}: records not read before launch (dataset {t.dataset!r} has its own loader)")
        return
    name, text_field = DATASET_LOADERS[t.dataset]
    try:
        files = data_files(path, name)
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, its own errors
        found.blockers.append(f"{where}: Hugging Face datasets finds no training data there ({type(e).__name__}: {e})")
        return
    if not files:
        found.blockers.append(f"{where} has no \"train\" split: name a file train.jsonl (or declare one in its dataset card)")
        return
    for f in files:
        if os.path.getsize(f) == 0:
            found.blockers.append(f"{where}: {f} is empty: it holds no records to train on; remove it or stage it again")
            return
    budget = [FULL_READ_BYTES if read_bytes is None else read_bytes]  # shared by the files, in order
    for f in files:
        problem, checked, read_to = records_problem(f, text_field, budget)
        if problem:
            found.blockers.append(f"{where}: {problem}")
            return
        if not checked:
            found.notes.append(f"{where}: records of {f} not read before launch (format not read here)")
        elif read_to is not None:
            found.notes.append(f"{where}: {f} read to line {read_to} and its last line ({_size(FULL_READ_BYTES)} "
                               "read before launch in all); a bad record after that stops the ranks, naming it")


def data_files(path: str, name: str | None) -> list[str]:
    """The files of the "train" split, as TorchTitan's `load_dataset(path, name)` resolves them."""
    import datasets

    builder = datasets.load_dataset_builder(path, name=name)
    by_split = builder.config.data_files or {}
    train = next((files for split, files in by_split.items() if str(split) == "train"), [])
    return [str(f) for f in train]


def records_problem(path: str, text_field: str, budget: list[int]) -> tuple[str, bool, int | None]:
    """(what stops training in a data file's records, "" if nothing; whether its format was
    read; the line the reading stopped at when `budget`, the bytes left to read, ran out first,
    else None)."""
    name = path.lower()
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        problem, read_to = _json_lines_problem(path, text_field, budget)
        return problem, True, read_to
    if name.endswith(".parquet"):
        return _parquet_problem(path, text_field), True, None
    if name.endswith(".txt"):
        return "", True, None  # the text builder makes one record per line, in field "text"
    return "", False, None


def _json_lines_problem(path: str, text_field: str, budget: list[int]) -> tuple[str, int | None]:
    """Every line while `budget` lasts (and always the first RECORDS_READ records), then the
    last line of a plain file (one seek: a truncated copy ends mid-record)."""
    opener = gzip.open if path.lower().endswith(".gz") else open
    records, number, read_to = 0, 0, None
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                budget[0] -= len(line)
                if not line.strip():
                    continue
                if number == 1 and line.lstrip().startswith("["):
                    return "", None  # one JSON array: datasets' json builder reads it whole
                cut = not line.endswith("\n")  # the file ends inside this record
                problem = _record_problem(line, f"line {number}, the last," if cut else f"line {number}", text_field)
                if problem:
                    return f"{path} {problem}" + (" (the file looks truncated: stage it again)" if cut else ""), None
                records += 1
                if records >= RECORDS_READ and budget[0] <= 0:
                    read_to = number
                    break
    except (OSError, EOFError, UnicodeDecodeError) as e:  # a broken gzip stream, bad bytes
        return f"{path} cannot be read ({type(e).__name__}: {e}); stage it again", None
    if records == 0:
        return f"{path} holds no records: stage the dataset again", None
    if read_to is not None and opener is open:
        last = _last_line(path)
        problem = _record_problem(last, "the last line", text_field) if last.strip() else ""
        if problem:
            return f"{path} {problem} (the file looks truncated: stage it again)", None
    return "", read_to


def _size(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1e3:,.0f} kB"


def _record_problem(line: str, where: str, text_field: str) -> str:
    """What is wrong with one JSON line ("" if nothing); `where` names it ("line 3")."""
    try:
        record = json.loads(line)
    except ValueError as e:
        return f"{where} is not a JSON record ({e})"
    if not isinstance(record, dict):
        return f"{where} is a JSON {type(record).__name__}, not a record with a {text_field!r} field"
    if text_field not in record:
        return (f"{where}: the record has no {text_field!r} field, which TorchTitan's loader reads "
                f"(it has {sorted(record)[:8]})")
    if not isinstance(record[text_field], str):
        return f"{where}: the record's {text_field!r} is a {type(record[text_field]).__name__}, not text"
    return ""


def _last_line(path: str) -> str:
    """The last line of a text file (read from its last MiB)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        f.seek(max(0, end - (1 << 20)))
        tail = f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    return tail.decode("utf-8", errors="replace")


def _parquet_problem(path: str, text_field: str) -> str:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError for a broken footer
        return f"{path} cannot be read as Parquet ({type(e).__name__}: {e}); stage it again"
    if text_field not in meta.schema_arrow.names:
        return f"{path} has no {text_field!r} column, which TorchTitan's loader reads (it has {meta.schema_arrow.names[:8]})"
    if meta.metadata.num_rows == 0:
        return f"{path} holds no records: stage the dataset again"
    return ""


# ---- dump folder ------------------------------------------------------------------------------

def dump_folder_problem(folder: str) -> str:
    """Why `folder` cannot hold a run's checkpoints, metrics and logs ("" when it can), found
    by creating and removing a scratch folder in it, or in its nearest existing ancestor (a
    check leaves nothing behind; `train` makes the folder when it claims it)."""
    path = Path(folder)
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "is a file" if existing == path else f"is under {str(existing)!r}, which is a file"
        return f"{where}: choose a folder path (--job.dump_folder DIR)"
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".moe_comm-probe-"))
    except OSError as e:
        what = "is not writable" if existing == path else "cannot be created"
        return f"{what} ({e.strerror}: {e.filename or existing}): choose a folder this user can write (--job.dump_folder DIR)"
    return ""
