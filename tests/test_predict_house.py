"""moe_comm.predict has no import circle: each module imports only the modules its package
docstring lists before it (module-level and function-level imports alike)."""

import ast
from pathlib import Path

import moe_comm.predict

PREDICT = Path(moe_comm.predict.__file__).parent


def _order() -> list[str]:
    lines = moe_comm.predict.__doc__.split("bottom to top", 1)[1].splitlines()[1:]
    return [line.split()[0] for line in lines if line.startswith("  ") and line.split()]


def _predict_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "moe_comm.predict":
                found |= {a.name for a in node.names}
            elif node.module.startswith("moe_comm.predict."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("moe_comm.predict.")}
    return found


def test_every_module_is_listed_and_imports_only_those_below_it():
    order = _order()
    files = {p.stem for p in PREDICT.glob("*.py")} - {"__init__"}
    assert set(order) == files, "list every moe_comm/predict module in its package docstring"
    for i, name in enumerate(order):
        later = _predict_imports(PREDICT / f"{name}.py") - set(order[:i])
        assert not later, f"moe_comm.predict.{name} imports {sorted(later)}, listed after it"


def test_the_checker_sees_every_import_form(tmp_path):
    """The parse above finds each form an import can take (so the test above can fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from moe_comm.predict import scale_model\nimport moe_comm.predict.validation\n"
                     "def f():\n    from moe_comm.predict.calibration import calibrate\n")
    assert _predict_imports(probe) == {"scale_model", "validation", "calibration"}
