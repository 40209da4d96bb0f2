"""The package's floors (moe_comm's docstring): every module imports only modules of its own
floor or below, and no imports go round in a circle; inside moe_comm.predict, each module
imports only the modules its package docstring lists before it. Imports inside functions count
as much as those at the top of a module: both run."""

import ast
from pathlib import Path

import moe_comm
import moe_comm.predict

PACKAGE = Path(moe_comm.__file__).parent
PREDICT = Path(moe_comm.predict.__file__).parent


def floors(doc: str) -> dict[str, int]:
    """Top-level room (module or subpackage of moe_comm) -> its floor, from the docstring's
    floor lines ("  N  room room ...")."""
    out = {}
    for line in doc.splitlines():
        words = line.split()
        if line.startswith("  ") and words and words[0].isdigit():
            for room in words[1:]:
                assert room not in out, f"{room} is listed on two floors"
                out[room] = int(words[0])
    return out


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package at `root` (a package is its
    __init__.py)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict[str, Path], package: str) -> set[str]:
    """The package's modules `path` imports, anywhere in it: `from a.b import c` is module
    a.b.c where that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == package:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == package}
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(root: Path, floor_of: dict[str, int]) -> list[str]:
    known = modules(root)
    wrong = []
    for name, path in sorted(known.items()):
        for target in sorted(imports(path, known, root.name)):
            if floor_of[room(target)] > floor_of[room(name)]:
                wrong.append(f"{name} (floor {floor_of[room(name)]}) imports {target} (floor {floor_of[room(target)]})")
    return wrong


def circles(root: Path) -> list[list[str]]:
    """Every set of modules whose imports lead back to each other (Tarjan's strongly connected
    components of more than one module)."""
    known = modules(root)
    graph = {name: sorted(imports(path, known, root.name) - {name}) for name, path in known.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_room_has_a_floor():
    floor_of = floors(moe_comm.__doc__)
    rooms = {room(name) for name in modules(PACKAGE)} - {"moe_comm"}
    assert rooms == set(floor_of), "list every module and subpackage of moe_comm on one floor of its docstring"


def test_no_module_imports_a_higher_floor():
    floor_of = floors(moe_comm.__doc__) | {"moe_comm": 1}
    assert upward_imports(PACKAGE, floor_of) == []


def test_no_import_circle():
    assert circles(PACKAGE) == []


def test_the_checker_finds_an_upward_import_and_a_circle(tmp_path):
    """A probe package with one import that runs up a floor (inside a function) and two modules
    that import each other: the checks above would fail on it."""
    probe = tmp_path / "probe"
    (probe / "upper").mkdir(parents=True)
    (probe / "__init__.py").write_text("")
    (probe / "low.py").write_text("def f():\n    from probe.upper import a\n")
    (probe / "upper" / "__init__.py").write_text("")
    (probe / "upper" / "a.py").write_text("import probe.upper.b\n")
    (probe / "upper" / "b.py").write_text("from probe.upper import a\n")
    floor_of = floors("  1  low\n  2  upper\n") | {"probe": 1}
    assert upward_imports(probe, floor_of) == ["probe.low (floor 1) imports probe.upper.a (floor 2)"]
    assert circles(probe) == [["probe.upper.a", "probe.upper.b"]]


# ---- inside moe_comm.predict: bottom to top, as its package docstring lists them ---------------

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


def test_every_predict_module_is_listed_and_imports_only_those_below_it():
    order = _order()
    files = {p.stem for p in PREDICT.glob("*.py")} - {"__init__"}
    assert set(order) == files, "list every moe_comm/predict module in its package docstring"
    for i, name in enumerate(order):
        later = _predict_imports(PREDICT / f"{name}.py") - set(order[:i])
        assert not later, f"moe_comm.predict.{name} imports {sorted(later)}, listed after it"


def test_the_predict_checker_sees_every_import_form(tmp_path):
    """The parse above finds each form an import can take (so the test above can fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from moe_comm.predict import scale_model\nimport moe_comm.predict.validation\n"
                     "def f():\n    from moe_comm.predict.calibration import calibrate\n")
    assert _predict_imports(probe) == {"scale_model", "validation", "calibration"}
