"""results/model_inputs is the one folder under results/ that moe_comm reads: its MANIFEST.json
lists exactly the files there, each with what it measured, where, when, with which kernels and
how it was made; no code under moe_comm names a results/ path outside it; and the validation
table's measured values agree with the archive files they were read from. CPU only."""

import ast
import json
import re
from pathlib import Path

import pytest

from moe_comm.predict import validation
from moe_comm.predict.assumptions import MODEL_INPUTS, REPO, VALIDATION

MANIFEST = MODEL_INPUTS / "MANIFEST.json"
ENTRY_FIELDS = {"measured", "machine", "date", "kernels", "code", "recorded_in", "was", "commands", "read_by"}
PACKAGE = REPO / "moe_comm"
INSIDE = "results/model_inputs/"
CITED_PATH = re.compile(r"results/[\w./-]*[\w/]")


def manifest() -> dict:
    return json.loads(MANIFEST.read_text())["files"]


def test_manifest_lists_exactly_the_files_in_the_folder():
    listed = set(manifest())
    present = {str(p.relative_to(MODEL_INPUTS)) for p in MODEL_INPUTS.rglob("*") if p.is_file()} - {MANIFEST.name}
    assert not listed - present, f"MANIFEST.json lists files that are not in {MODEL_INPUTS}: {sorted(listed - present)}"
    assert not present - listed, (f"{MODEL_INPUTS} holds files MANIFEST.json does not describe: {sorted(present - listed)}"
                                  " (add an entry: what it measured, machine, date, kernels, code, command)")


def test_every_entry_says_what_where_when_which_kernels_and_how():
    for name, entry in manifest().items():
        missing = ENTRY_FIELDS - set(entry)
        assert not missing, f"MANIFEST.json {name}: missing {sorted(missing)}"
        assert entry["measured"] and entry["machine"] and entry["date"] and entry["commands"], name
        if entry["kernels"] is not None:  # a measurement: the commit whose csrc/ ran (None: none of ours)
            commit = entry["kernels"]["commit"]
            assert commit is None or re.fullmatch(r"[0-9a-f]{7,40}", commit), (name, commit)


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """Every string constant of a module but its docstrings (which may point people anywhere)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings]


def _path_parts(node: ast.AST) -> list:
    """The operands of a chain of `/` joins, left to right (a constant's value, else None)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _path_parts(node.left) + _path_parts(node.right)
    return [node.value if isinstance(node, ast.Constant) else None]


def _outside_reads(source: str) -> list[str]:
    tree = ast.parse(source)
    bad = []
    for node in _code_strings(tree):
        for path in CITED_PATH.findall(node.value):
            if not (path + "/").startswith(INSIDE) and not path.endswith(".md"):  # .md: a document cited to people
                bad.append(f"line {node.lineno}: {path!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = _path_parts(node)
            for i, part in enumerate(parts[:-1]):
                if part == "results" and parts[i + 1] != "model_inputs":
                    bad.append(f"line {node.lineno}: a path joined as results / {parts[i + 1]!r}")
    return sorted(set(bad))


def test_no_code_in_moe_comm_names_a_results_path_outside_the_folder():
    bad = {str(p.relative_to(REPO)): found for p in sorted(PACKAGE.rglob("*.py"))
           if (found := _outside_reads(p.read_text()))}
    assert not bad, (f"moe_comm reads under results/ only from {INSIDE} (move the file there and describe it in "
                     f"MANIFEST.json): {bad}")


def test_the_check_catches_a_read_outside_the_folder():
    """The scan above would see both ways a module could name an archive file."""
    assert _outside_reads('X = REPO / "results" / "h200x2" / "comm_bench.json"\n')
    assert _outside_reads('def f():\n    """Docs may cite results/h200x2."""\n    return open("results/h200x1/a.json")\n')
    assert not _outside_reads('X = REPO / "results" / "model_inputs"\nY = "see results/scale_model.md"\n')
    assert not _outside_reads('"""The figures: results/h200x1/README.md, results/h200x2."""\n')


def test_every_results_path_cited_in_moe_comm_exists():
    """Docstrings and comments point people at results/ for figures: each pointer still leads somewhere."""
    stale = [f"{p.relative_to(REPO)}: {path}" for p in sorted(PACKAGE.rglob("*.py"))
             for path in CITED_PATH.findall(p.read_text()) if not (REPO / path).exists()]
    assert not stale, f"results/ paths cited in moe_comm that do not exist: {stale}"


@pytest.mark.parametrize("fig", json.loads(VALIDATION.read_text())["figures"], ids=lambda f: f["id"])
def test_each_validation_value_is_the_one_its_archive_file_gives(fig):
    m = fig["measured"]
    assert "value" in m, (f"{fig['id']}: no measured.value, so moe_comm would read {m.get('file')} at run time; "
                          f"write \"value\": {validation.measured(fig)!r} into its row")
    if "file" not in m:  # a public anchor: its value and its source
        assert m.get("source"), fig["id"]
        return
    assert (REPO / m["file"]).is_file(), f"{fig['id']}: {m['file']} is gone from the archive"
    from_file = validation.measured({**fig, "measured": {k: v for k, v in m.items() if k != "value"}})
    assert m["value"] == from_file, f"{fig['id']}: measured.value {m['value']!r}, but {m['file']} gives {from_file!r}"


def test_a_run_is_read_one_row_per_step_and_an_unknown_reduce_is_named(tmp_path, monkeypatch):
    """A run's metrics.jsonl is read as `report` reads it (a restart's rows replace the earlier
    ones from its step on), and a reduce the table cannot mean is an error naming the field."""
    run = tmp_path / "metrics.jsonl"
    steps = [(1, 10.0), (2, 20.0), (3, 90.0), (2, 21.0), (3, 30.0), (4, 40.0)]  # restarted at step 2
    run.write_text("".join(json.dumps({"step": s, "tps": v}) + "\n" for s, v in steps))
    monkeypatch.setattr(validation, "REPO", tmp_path)
    fig = {"id": "t", "measured": {"file": "metrics.jsonl", "field": "tps"}}
    assert validation.measured(fig) == 40.0  # max: the superseded 90 is gone
    assert validation.measured({**fig, "measured": {**fig["measured"], "reduce": "median", "after_step": 1}}) == 30.0
    with pytest.raises(ValueError, match=r"t: measured.reduce 'mean' is not one of \['last', 'max', 'median'\]"):
        validation.measured({**fig, "measured": {**fig["measured"], "reduce": "mean"}})
