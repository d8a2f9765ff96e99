"""The package layout: imports run one way, floor by floor (docs/contributing.md draws the floors): kernels <- ops
<- layers <- models <- utils <- data <- training <- benchmark, export (beside each other) <- experiments, with
the diffusion stack on utils and data only, and tools on top."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The floors, lowest first; a package imports from its own and the floors below, never from one beside it.
FLOORS = [("kernels",), ("ops",), ("layers",), ("models",), ("utils",), ("data",), ("training",),
          ("benchmark", "export"), ("experiments",)]
MAY_IMPORT = {}
_below = set()
for _floor in FLOORS:
    MAY_IMPORT.update({p: _below | {p} for p in _floor})
    _below |= set(_floor)
MAY_IMPORT["diffusion"] = MAY_IMPORT["data"] | {"diffusion"}  # the shared utilities and data, never the trainer
MAY_IMPORT["tools"] = _below | {"diffusion", "tools"}  # anything
MAY_IMPORT["configs"] = {"configs"}  # the shipped YAML files: data, no imports


def _imports(path):
    """(module imported, at module level?) for every import statement of a file; relative ones as '.name'."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, id(node) in top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or ""), id(node) in top


def test_imports_run_one_way_ops_to_kernels():
    """kernels/ import nothing from linvision (the shared module is linvision/kernels/common.py, which imports neither
    Triton nor linvision); linvision/ops takes the shared checks and constants through ops/common.py, the one ops
    module that imports linvision/kernels/common.py, imports the Triton kernels only inside the dispatchers, and nothing from
    the layers or models."""
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "linvision" / "kernels").glob("*.py")):
        for module, _ in _imports(path):
            assert not module.startswith("linvision"), f"{path.name} imports {module}"
    assert {m for m, _ in _imports(root / "linvision" / "kernels" / "common.py")} <= {"__future__", "dataclasses", "typing", "torch"}
    ops = root / "linvision" / "ops"
    paths = sorted(ops.rglob("*.py"))
    assert ops / "attention" / "dispatch.py" in paths and ops / "recurrent" / "kernels.py" in paths
    for path in paths:
        for module, top_level in _imports(path):
            if module.startswith("linvision"):
                assert (module == "linvision.kernels.common" and path == ops / "common.py") or (
                    module == "linvision.kernels" and not top_level
                ), f"{path.relative_to(root)} imports {module}"
            assert not module.startswith("triton"), f"{path.relative_to(root)} imports {module}"


def _package_of(module, path):
    """The linvision package an import names ('ops', 'kernels', ...), or None for anything else; relative
    imports are resolved against the file's own package."""
    if module.startswith("."):
        level = len(module) - len(module.lstrip("."))
        parts = path.relative_to(ROOT).with_suffix("").parts[:-level] + tuple(filter(None, module[level:].split(".")))
    else:
        parts = tuple(module.split("."))
    if parts[:1] == ("linvision",):
        parts = parts[1:]
    return parts[0] if parts and parts[0] in MAY_IMPORT else None


def test_every_package_stands_on_a_floor():
    """A new folder of linvision/ has to be placed on a floor (here and on the Contributing page) before it imports
    anything."""
    packages = {p.name for p in (ROOT / "linvision").iterdir() if (p / "__init__.py").is_file()}
    assert packages - set(MAY_IMPORT) == set(), "packages on no floor"
    assert MAY_IMPORT["diffusion"] == {"kernels", "ops", "layers", "models", "utils", "data", "diffusion"}
    assert "benchmark" not in MAY_IMPORT["export"] and "export" not in MAY_IMPORT["benchmark"]


def test_the_former_engine_package_is_gone():
    """linvision.engine, the former home of the tools' library code, was removed after a release of deprecation
    warnings: it no longer imports, and nothing in linvision/ refers to it."""
    import importlib

    assert not (ROOT / "linvision" / "engine").exists()
    with pytest.raises(ModuleNotFoundError, match="linvision.engine"):
        importlib.import_module("linvision.engine")
    for path in (ROOT / "linvision").rglob("*.py"):
        used = [m for m, _ in _imports(path) if m.startswith("linvision.engine")]
        assert not used, f"{path.relative_to(ROOT)} imports {used}"


def test_every_package_imports_downward_only():
    files = [p for p in (ROOT / "linvision").rglob("*.py") if p.parent != ROOT / "linvision"]
    assert len(files) > 40
    checked = 0
    for path in files:
        rel = path.relative_to(ROOT).parts
        own = rel[1]
        for module, _ in _imports(path):
            other = _package_of(module, path)
            if other is not None:
                checked += 1
                assert other in MAY_IMPORT[own], f"{'/'.join(rel)} ({own}) imports {module} ({other})"
    assert checked > 40


def test_safe_pickle_imports_nothing_of_linvision():
    """The checkpoint reader that models and training share sits below both: it imports nothing of linvision."""
    assert not [m for m, _ in _imports(ROOT / "linvision" / "safe_pickle.py") if m.startswith(("linvision", "."))]


def _module_files():
    """{dotted module name: (path, is a package's __init__)} for linvision and the kernels it installs."""
    out = {}
    for top, prefix in (("linvision", ("linvision",)), ("kernels", ("linvision", "kernels"))):
        for path in (ROOT / top).rglob("*.py"):
            parts = prefix + path.relative_to(ROOT / top).with_suffix("").parts
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


def _imported_modules(module, path, init):
    """The module names an import statement of the file names, relative imports resolved (``from X import Y``
    counts X and X.Y), imports inside functions included."""
    package = module if init else module.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names += [origin] + [f"{origin}.{a.name}" for a in node.names]
    return names


def test_no_import_circle_between_modules():
    """No two modules import each other, directly or round a circle, not even from inside a function (a lazy
    import that hides a circle still ties the two modules together)."""
    modules = _module_files()
    graph = {m: {n for n in _imported_modules(m, path, init) if n in modules and n != m and not modules[n][1]}
             for m, (path, init) in modules.items() if not init}
    assert "linvision.data.in_memory" in graph["linvision.data.texture"]
    state, circles = {}, []

    def visit(m, trail):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                circles.append(" -> ".join(trail[trail.index(n):] + [n]))
            elif n not in state:
                visit(n, trail + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def _layout_entries():
    """The layout block of docs/contributing.md as {folder: its text}, one entry per line that starts at column 0."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    entries, current = {}, None
    for line in block.splitlines():
        if line and not line[0].isspace():
            current = line.split()[0].rstrip("/")
            entries[current] = line
        elif current is not None:
            entries[current] += "\n" + line
    return entries


def test_contributing_page_names_every_module_where_it_lives():
    """Every module of kernels/ and of each linvision package (its sub-packages included) is named, as NAME.py, in
    that folder's entry of the Contributing page's layout, and every NAME.py an entry names exists in its folder."""
    import re

    entries = _layout_entries()
    folders = {f"linvision/{p.name}": p for p in (ROOT / "linvision").iterdir()
               if p.is_dir() and (p / "__init__.py").is_file()}
    for name, folder in folders.items():
        assert name in entries, f"docs/contributing.md has no entry for {name}/"
        named = set(re.findall(r"(\w+)\.py", entries[name]))
        present = {p.stem for p in folder.rglob("*.py") if p.stem != "__init__"}
        assert present - named == set(), f"{name}: modules the Contributing page does not name"
        assert named - present == set(), f"{name}: the Contributing page names modules that do not exist"


def test_no_function_of_linvision_is_longer_than_80_lines():
    """Readable at once: every function and method under linvision/ (its def line to its last, docstring included)
    fits in 80 lines; a longer one is split into named steps."""
    long = []
    for path in sorted((ROOT / "linvision").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_token_mixers_are_registered_in_layers_only():
    """One home per mechanism: every registered token mixer is defined in a module of linvision/layers (its ablation
    and published forms together); the model files import their mixers and register none."""
    import linvision  # noqa: F401  (registers everything)
    from linvision.layers import get_mixer_class, list_mixers

    homes = {get_mixer_class(name).__module__ for name in list_mixers()}
    assert homes and all(m.startswith("linvision.layers.") for m in homes), sorted(homes)
    for path in (ROOT / "linvision").rglob("*.py"):
        if path.parent != ROOT / "linvision" / "layers":
            assert "register_mixer" not in path.read_text(), f"{path.relative_to(ROOT)} registers a mixer"


def test_no_name_shadows_a_module():
    """Every module of linvision/ is reached by attribute from its package after import (``import
    linvision.ops.attention.dispatch`` then ``linvision.ops.attention.dispatch``): no re-exported function or class
    carries the name of the module it sits beside."""
    import importlib

    modules = [p.relative_to(ROOT).with_suffix("") for p in (ROOT / "linvision").rglob("*.py")
               if p.name != "__init__.py" or p.parent != ROOT / "linvision"]
    assert len(modules) > 40
    for rel in modules:
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        name = ".".join(parts)
        module = importlib.import_module(name)
        found = importlib.import_module("linvision")
        for attr in parts[1:]:
            found = getattr(found, attr)
        assert found is module, f"{name} is shadowed by {found!r}"


def test_no_test_file_imports_another():
    """What several test files share lives in tests/support.py: no test file imports another test file (importing
    one runs its module-level parametrisation and fixtures again, and ties the two files' names together)."""
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    for path in sorted((ROOT / "tests").glob("*.py")):
        imported = {name.split(".")[0] for name, _ in _imports(path)} & tests
        assert not imported, f"{path.name} imports test files {sorted(imported)}: move what they share to support.py"
