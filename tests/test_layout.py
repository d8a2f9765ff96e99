"""The package layout: imports run one way, kernels <- ops <- layers <- models <- engine <- diffusion <- tools."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each package may import from packages of lower or equal rank only.
RANK = {"kernels": 0, "ops": 1, "layers": 2, "models": 3, "engine": 4, "diffusion": 5, "tools": 6}


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
    """kernels/ import nothing from linvision (the shared module is kernels/common.py, which imports neither
    Triton nor linvision); linvision/ops takes the shared checks and constants through ops/common.py, the one ops
    module that imports kernels/common.py, imports the Triton kernels only inside the dispatchers, and nothing from
    the layers or models."""
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "kernels").glob("*.py")):
        for module, _ in _imports(path):
            assert not module.startswith("linvision"), f"{path.name} imports {module}"
    assert {m for m, _ in _imports(root / "kernels" / "common.py")} <= {"__future__", "dataclasses", "typing", "torch"}
    ops = root / "linvision" / "ops"
    paths = sorted(ops.rglob("*.py"))
    assert ops / "linear_attention" / "dispatch.py" in paths and ops / "recurrent" / "kernels.py" in paths
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
    return parts[0] if parts and parts[0] in RANK else None


def test_every_package_imports_downward_only():
    files = [p for p in (ROOT / "linvision").rglob("*.py") if p.parent != ROOT / "linvision"]
    files += list((ROOT / "kernels").glob("*.py")) + list((ROOT / "tools").glob("*.py"))
    assert len(files) > 40
    checked = 0
    for path in files:
        rel = path.relative_to(ROOT).parts
        own = rel[1] if rel[0] == "linvision" else rel[0]
        for module, _ in _imports(path):
            other = _package_of(module, path)
            if other is not None:
                checked += 1
                assert RANK[other] <= RANK[own], f"{'/'.join(rel)} ({own}) imports {module} ({other})"
    assert checked > 40


def test_safe_pickle_imports_nothing_of_linvision():
    """The checkpoint reader that models and engine share sits below both: it imports nothing of linvision."""
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
    assert "linvision.engine.in_memory" in graph["linvision.engine.texture_data"]
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
    folders = {"kernels": ROOT / "kernels"}
    folders.update({f"linvision/{p.name}": p for p in (ROOT / "linvision").iterdir()
                    if p.is_dir() and (p / "__init__.py").is_file()})
    for name, folder in folders.items():
        assert name in entries, f"docs/contributing.md has no entry for {name}/"
        named = set(re.findall(r"(\w+)\.py", entries[name]))
        present = {p.stem for p in folder.rglob("*.py") if p.stem != "__init__"}
        assert present - named == set(), f"{name}: modules the Contributing page does not name"
        assert named - present == set(), f"{name}: the Contributing page names modules that do not exist"
