"""What a recipe reads and writes on disk (moe_comm.files), before any rank starts: the dump
folder, the first records of a local dataset, the tokenizer; and `check` on a machine without
the flagship's tokenizer and data (it plans anyway, then lists the launch blockers).

Before: an unusable dump folder gave a raw traceback and passed `check`; an empty, truncated or
text-less dataset started torchrun and failed in every rank; `check` stopped at the first
missing asset without a plan."""

import gzip
import json
import shutil
from pathlib import Path

import pytest

from moe_comm import files, gpus, recipe
from moe_comm.__main__ import main

REPO = Path(__file__).resolve().parents[1]
DEBUG = "recipes/debug_cpu.toml"
FLAGSHIP = "recipes/deepseek_v3_671b_b200.toml"
TINY_DATA = REPO / "assets" / "tiny" / "c4_tiny" / "train.jsonl"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def _blockers(*overrides: str) -> list[str]:
    with pytest.raises(recipe.LaunchBlockers) as e:
        recipe.load(DEBUG, list(overrides), device="cpu")
    return e.value.blockers


# ---- dump folder ------------------------------------------------------------------------------

def _bad_dump_folders(tmp_path: Path) -> dict[str, tuple[str, str]]:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    return {
        "under /proc": ("/proc/nope", "cannot be created"),
        "a file": (str(a_file), "is a file"),
        "under a file": (str(a_file / "run"), f"is under {str(a_file)!r}, which is a file"),
    }


@pytest.mark.parametrize("case", ["under /proc", "a file", "under a file"])
def test_an_unusable_dump_folder_is_named_by_check_submit_and_train(case, tmp_path, capsys):
    folder, why = _bad_dump_folders(tmp_path)[case]
    field = f"[job] dump_folder = {folder!r} {why}"

    assert main(["check", DEBUG, "--job.dump_folder", folder]) == 1
    out = capsys.readouterr().out
    assert "layout      world 2" in out and f"  - {field}" in out, out

    assert main(["train", DEBUG, "--dry-run", "--job.dump_folder", folder]) == 2
    err = capsys.readouterr().err
    assert f"recipe error: {field}" in err and "Traceback" not in err, err

    assert main(["submit", DEBUG, "--job.dump_folder", folder]) == 2  # refused before sbatch is looked for
    err = capsys.readouterr().err
    assert f"submit: {field}" in err, err

    # a dry run renders the script (the paths may be the cluster's) and lists what a real submit
    # from here refuses, in check's words
    assert main(["submit", DEBUG, "--dry-run", "--job.dump_folder", folder]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("#!/bin/bash")
    assert "submit: launch blockers (1): " in out.err and f"submit:   - {field}" in out.err, out.err


def test_a_writable_dump_folder_passes_and_nothing_is_left_behind(tmp_path):
    assert files.dump_folder_problem(str(tmp_path / "new" / "run")) == ""
    assert files.dump_folder_problem(str(tmp_path)) == ""
    assert list(tmp_path.iterdir()) == []  # only probed


# ---- dataset ----------------------------------------------------------------------------------

def _dataset(tmp_path: Path, name: str, content: bytes | None) -> str:
    folder = tmp_path / "data"
    folder.mkdir()
    if content is not None:
        (folder / name).write_bytes(content)
    return str(folder)


def _lines(n: int, **record) -> bytes:
    return b"".join(json.dumps(record or {"text": f"record {i}"}).encode() + b"\n" for i in range(n))


BAD_DATASETS = [
    ("empty folder", "train.jsonl", None, ["finds no training data", "doesn't contain any data files"]),
    ("empty file", "train.jsonl", b"", ["train.jsonl is empty"]),
    ("only blank lines", "train.jsonl", b"\n\n", ["holds no records"]),
    ("no text field", "train.jsonl", _lines(3, body="hello"), ["line 1: the record has no 'text' field", "['body']"]),
    ("text not a string", "train.jsonl", _lines(2, text=7), ["line 1: the record's 'text' is a int"]),
    ("not JSON", "train.jsonl", b"hello world\n", ["line 1 is not a JSON record"]),
    ("truncated", "train.jsonl", _lines(50)[:-9], ["line 50, the last, is not a JSON record", "truncated"]),
    ("truncated early", "train.jsonl", _lines(50)[:30], ["line 2, the last, is not a JSON record"]),
    ("broken gzip", "c4-train.00000-of-01024.json.gz", gzip.compress(_lines(2000))[:30], ["cannot be read"]),
    ("gzip without text", "c4-train.00000-of-01024.json.gz", gzip.compress(_lines(3, url="u")), ["no 'text' field"]),
]


@pytest.mark.parametrize("what,name,content,words", BAD_DATASETS, ids=[b[0] for b in BAD_DATASETS])
def test_a_dataset_that_cannot_train_is_refused_naming_file_record_and_field(what, name, content, words, tmp_path):
    folder = _dataset(tmp_path, name, content)
    (blocker,) = _blockers("--training.dataset_path", folder)
    assert blocker.startswith(f"[training] dataset_path = {folder!r}: "), blocker
    if content is not None and content:
        assert str(Path(folder) / name) in blocker, blocker
    for word in words:
        assert word in blocker, f"{what}: {word!r} not in {blocker!r}"


def test_the_configuration_titans_c4_loader_asks_for_must_exist():
    """TorchTitan loads "c4" with name="en": the tiny folder (no dataset card) has no such
    configuration, so the ranks would fail in load_dataset."""
    (blocker,) = _blockers("--training.dataset", "c4")
    assert "BuilderConfig 'en' not found" in blocker


def test_good_datasets_pass(tmp_path):
    folder = Path(_dataset(tmp_path, "c4-train.00000-of-00002.json.gz", gzip.compress(_lines(20))))
    (folder / "c4-train.00001-of-00002.json.gz").write_bytes(gzip.compress(_lines(3)))
    recipe.load(DEBUG, ["--training.dataset_path", str(folder)], device="cpu")
    recipe.load(DEBUG, device="cpu")  # the shipped tiny dataset


def test_every_data_file_of_the_split_must_hold_something(tmp_path):
    folder = Path(_dataset(tmp_path, "train-0.jsonl", _lines(4)))
    (folder / "train-1.jsonl").write_bytes(b"")
    (blocker,) = _blockers("--training.dataset_path", str(folder))
    assert f"{folder / 'train-1.jsonl'} is empty" in blocker


def test_train_refuses_a_bad_dataset_before_torchrun(tmp_path, capsys):
    folder = _dataset(tmp_path, "train.jsonl", _lines(3, body="x"))
    assert main(["train", DEBUG, "--dry-run", "--job.dump_folder", str(tmp_path / "d"),
                 "--training.dataset_path", folder]) == 2
    out = capsys.readouterr()
    assert "no 'text' field" in out.err and "torch.distributed.run" not in out.out


# ---- tokenizer --------------------------------------------------------------------------------

def test_a_recipe_without_hf_assets_path_is_told_it_is_unset(tmp_path):
    text = (REPO / DEBUG).read_text().replace('hf_assets_path = "./assets/tiny"\n', "")
    path = tmp_path / "r.toml"
    path.write_text(text)
    with pytest.raises(recipe.LaunchBlockers) as e:
        recipe.load(str(path), device="cpu")
    (blocker,) = e.value.blockers
    assert blocker.startswith("[model] hf_assets_path is not set, so TorchTitan reads its own default "
                              "'./tests/assets/tokenizer'"), blocker
    assert "./assets/tiny" in blocker


def test_the_assets_verb_is_suggested_only_when_it_can_fetch(tmp_path):
    (blocker,) = _blockers("--model.hf_assets_path", str(tmp_path / "none"))
    assert "moe_comm assets" in blocker and "[assets] tokenizer_repo" in blocker and "fetches it" not in blocker
    (blocker,) = _blockers("--model.hf_assets_path", str(tmp_path / "none"), "--assets.tokenizer_repo", "org/tok")
    assert "fetches it from org/tok" in blocker


def test_a_stand_in_tokenizer_far_smaller_than_the_model_is_a_warning(capsys, monkeypatch):
    tiny = ["--model.hf_assets_path", "./assets/tiny", "--training.dataset", "c4_test",
            "--training.dataset_path", "./assets/tiny/c4_tiny"]
    r = recipe.load(FLAGSHIP, tiny)
    (warning,) = [w for w in r.warnings if w.startswith("[model] hf_assets_path")]
    assert "a 453-token tokenizer for a model of 129,280" in warning and "stand-in" in warning
    assert recipe.load(DEBUG, device="cpu").warnings == []  # debugmodel embeds 2,048: 4.5x, not a stand-in
    monkeypatch.setattr(gpus, "this_machine", lambda: None)
    assert main(["check", FLAGSHIP, *tiny]) == 1  # the files are there; what blocks is this machine's lack of a GPU
    out = capsys.readouterr().out
    assert f"warning     {warning}" in out
    assert "launch blockers (1)" in out and "  - `train` on this machine (no CUDA GPU) refuses this recipe: " in out


def test_a_tokenizer_larger_than_the_embedding_is_a_blocker(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(REPO / "assets" / "tiny", folder, ignore=shutil.ignore_patterns("c4_tiny"))
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"].append({**data["added_tokens"][0], "id": 5000, "content": "<|big|>"})
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (blocker,) = _blockers("--model.hf_assets_path", str(folder))
    assert "makes ids up to 5000, beyond [model] flavor = 'debugmodel''s vocab_size 2048" in blocker


# ---- check plans from a laptop ----------------------------------------------------------------

def test_check_plans_the_flagship_without_its_tokenizer_and_data(capsys, monkeypatch):
    """No DeepSeek-V3 tokenizer, no /data/c4 and no GPU here: the layout, memory and predictions
    still print, then the blockers with their fix (the files, then what `train` refuses on this
    machine), and the exit status says it cannot launch."""
    assert not Path("/data/c4").exists() and not (REPO / "assets" / "hf" / "DeepSeek-V3").exists()
    monkeypatch.setattr(gpus, "this_machine", lambda: None)
    assert main(["check", FLAGSHIP]) == 1
    out = capsys.readouterr().out
    for line in ("layout      world 256", "memory/GPU  ", "scale model B200", "expected fastest on this cluster"):
        assert line in out, out
    blockers = out.split("launch blockers (3):", 1)[1].splitlines()[1:]
    assert blockers[0].startswith("  - [model] hf_assets_path = './assets/hf/DeepSeek-V3' is not a directory")
    assert blockers[1].startswith("  - [training] dataset_path = '/data/c4' does not exist: ")
    assert all(f"python -m moe_comm assets {FLAGSHIP}" in b for b in blockers[:2])
    assert blockers[2].startswith("  - `train` on this machine (no CUDA GPU) refuses this recipe: ")
    # --skip-files: checking a recipe for another machine, nothing blocks here
    assert main(["check", FLAGSHIP, "--skip-files"]) == 0
    assert "ready       nothing blocks a launch" in capsys.readouterr().out


# ---- a corrupt record deep in a local dataset (issue 32 item 9) -------------------------------

def _deep(n: int = 600, bad_at: int = 401, bad: bytes = b'{"text": "cut off here\n') -> bytes:
    lines = _lines(n).splitlines(keepends=True)
    lines[bad_at - 1] = bad
    return b"".join(lines)


DEEP = [
    ("cut mid-record", b'{"text": "cut off here\n', "line 401 is not a JSON record"),
    ("no text field", b'{"body": "x"}\n', "line 401: the record has no 'text' field"),
    ("text not a string", b'{"text": null}\n', "line 401: the record's 'text' is a NoneType, not text"),
]


@pytest.mark.parametrize("what,bad,words", DEEP, ids=[d[0] for d in DEEP])
def test_a_corrupt_record_deep_in_a_local_file_is_named_before_launch(what, bad, words, tmp_path):
    """Line 401 of 600: named once with its file, line and field before any rank starts (the first
    records and the last line were all that was read: torchrun started and every rank failed)."""
    folder = _dataset(tmp_path, "train.jsonl", _deep(bad=bad))
    (blocker,) = _blockers("--training.dataset_path", folder)
    assert f"{Path(folder) / 'train.jsonl'} {words}" in blocker, blocker


def test_every_file_of_the_split_is_read_and_gzip_too(tmp_path):
    folder = Path(_dataset(tmp_path, "c4-train.00000-of-00002.json.gz", gzip.compress(_lines(300))))
    (folder / "c4-train.00001-of-00002.json.gz").write_bytes(gzip.compress(_deep(bad=b'{"url": "u"}\n')))
    (blocker,) = _blockers("--training.dataset_path", str(folder))
    assert f"{folder / 'c4-train.00001-of-00002.json.gz'} line 401: the record has no 'text' field" in blocker


def test_beyond_the_reading_bound_the_rest_is_a_note(tmp_path, monkeypatch):
    """A dataset larger than what is read before launch: its first records and its last line are
    checked, and a note says how far the reading went (the ranks name a bad record later)."""
    monkeypatch.setattr(files, "FULL_READ_BYTES", 2_000)
    folder = _dataset(tmp_path, "train.jsonl", _deep())
    r = recipe.load(DEBUG, ["--training.dataset_path", folder], device="cpu")
    assert r.blockers == []
    (note,) = [n for n in r.notes if "dataset_path" in n]
    assert "train.jsonl read to line 9" in note and "2 kB read before launch" in note, note


def _titan_config(dataset_path: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", DEBUG, "--training.dataset_path", dataset_path])


@pytest.mark.parametrize("what,bad,words", DEEP[:2], ids=[d[0] for d in DEEP[:2]])
def test_past_the_bound_the_rank_names_the_record_in_one_error(what, bad, words, tmp_path):
    """A bad record `train` did not reach before launch: TorchTitan's loader fails on it in the
    rank (datasets' JSON reader while loading, or the text field while training), and the train
    spec's dataloader (moe_comm.titan.data) raises one RecipeError naming file, line and field."""
    import moe_comm.titan  # noqa: F401  registers the flavors, the CPU adaptations
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from moe_comm.titan import data

    folder = _dataset(tmp_path, "train.jsonl", _deep(bad=bad))
    tokenizer = HuggingFaceTokenizer(str(REPO / "assets" / "tiny"))
    with pytest.raises(recipe.RecipeError) as e:
        loader = data.build_dataloader(1, 0, tokenizer, _titan_config(folder), infinite=False)
        for _ in loader:
            pass
    assert f"{Path(folder) / 'train.jsonl'} {words}" in str(e.value) and "\n" not in str(e.value)


def test_the_rank_prints_a_recipe_error_as_one_line(tmp_path, capsys, monkeypatch):
    """No traceback on the console for bad input only a rank could see: one line, the traceback in
    the rank's log."""
    from moe_comm import console

    monkeypatch.setattr(console.sys, "excepthook", lambda *exc_info: pytest.fail("a traceback was printed"))
    monkeypatch.setenv("RANK", "1")
    log = console.RankLogFile()
    log.open(str(tmp_path / "rank1.log"))
    console._write_pending_on_crash(log)
    try:
        raise recipe.RecipeError("[training] dataset_path = './d': ./d/train.jsonl line 401 is not a JSON record")
    except recipe.RecipeError as e:
        console.sys.excepthook(type(e), e, e.__traceback__)
    assert capsys.readouterr().err == ("moe_comm: rank 1: [training] dataset_path = './d': ./d/train.jsonl line 401 "
                                       "is not a JSON record\n")
    assert "Traceback (most recent call last)" in (tmp_path / "rank1.log").read_text()
