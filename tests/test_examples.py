"""The Python examples of README.md and of the manual (docs/**/*.md) run as printed, each in a fresh namespace and
an empty folder, the results their comments state (shapes such as `# (2, 6, 3072, 48)` or `# (B, H, N, Dv)`, dtypes,
printed values) are what they give, and every tool command line of their shell blocks is one the tool's parser
accepts.

Examples that need a GPU are skipped without one; those that load a run folder ("output/...") need a training
command first, those that name a hub tag download weights, and those that name a local weights file need it on the
machine: all four are skipped, saying which, and what they call is checked by the kernel, tool and model tests
instead."""
import ast
import builtins
import io
import os
import re
import tokenize

import pytest
import torch
from support import PAGES, SCRIPTS, command_parser, fenced_blocks, joined_lines, python_examples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = python_examples()


def test_pages_have_examples():
    pages = {page for page, _, _ in EXAMPLES}
    assert "README.md" in pages and len(pages) >= 6, pages
    assert len(EXAMPLES) >= 12


def skip_reason(code: str):
    if ('"cuda"' in code or ".cuda()" in code) and not torch.cuda.is_available():
        return "needs a GPU"
    if re.search(r'"(local-dir:)?output/', code):
        return "needs a trained run folder (the training command of the same page)"
    if re.search(r'create_model\("[^"]+\.[^"]+", pretrained=True', code):
        return "downloads pretrained weights from the hub"
    if re.search(r'pretrained_cfg_overlay=dict\(file="', code):
        return "needs the authors' weights file on this machine"
    return None


DTYPES = ("float16", "bfloat16", "float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
_DIM = r"\s*(?:\d+|[A-Za-z_]\w*)\s*"
# a shape stated in a comment: "(2, 6, 3072, 48)", "(B, H, N, Dv)", "int64 (128, 128)"; at least one comma
STATED_SHAPE = re.compile(rf"(?:\b({'|'.join(DTYPES)})\s+)?\(({_DIM}(?:,{_DIM})*,?)\)")


def stated_shapes(comment: str):
    """The shapes a comment states, in order, as (dtype name or None, dims), each dim an int or a symbol such as
    "B" or "Dv"; "O(N)" and "(cached per grid, device)" are no shapes."""
    found = []
    for m in STATED_SHAPE.finditer(comment):
        if "," in m.group(2):
            dims = tuple(int(d) if d.isdigit() else d for d in (x.strip() for x in m.group(2).split(",")) if d)
            found.append((m.group(1), dims))
    return found


def _render(value) -> str:
    """A printed value as the manual writes it: a shape as a tuple, (1, 10), not torch.Size([1, 10])."""
    if isinstance(value, torch.Size):
        return str(tuple(value))
    if isinstance(value, (list, tuple)):
        inner = ", ".join(map(_render, value))
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return str(value)


class StatedResults:
    """The results an example's comments state, checked as the example runs.

    A statement `name = ...` or `a, b = ...` whose comment states shapes (one for every name, or one for all) is
    followed by a check of each name's shape and, where the comment names a dtype before a shape, its dtype. A
    `print(...)` whose comment ends in `: TEXT` must print TEXT (a shape printed as a tuple), and one whose
    comment states shapes but no such text has its printed values checked against them. A dim named by a symbol
    (`B`, `N`, `Dv`) takes the value it first has in the example and must keep it in every later comment of the
    example. Every check must be reached when the example runs."""

    def __init__(self, page: str, first_line: int, code: str):
        self.page, self.first_line = page, first_line
        self.comments = {tok.start[0]: tok.string.lstrip("#").strip()
                         for tok in tokenize.generate_tokens(io.StringIO(code).readline)
                         if tok.type == tokenize.COMMENT}
        self.checks, self.reached, self.symbols, self.printed = [], set(), {}, ()
        tree = ast.parse(code)
        tree.body = self._instrument(tree.body)
        self.code = compile(ast.fix_missing_locations(tree), f"{page}:{first_line}", "exec")

    def _instrument(self, body):
        out = []
        for stmt in body:
            out.append(stmt)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # names inside a function are not the example's
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    setattr(stmt, field, self._instrument(inner))
            for handler in getattr(stmt, "handlers", []):
                handler.body = self._instrument(handler.body)
            check = self._check_of(stmt)
            if check is not None:
                self.checks.append(check)
                call = ast.Call(ast.Name("__stated_result__", ast.Load()), [ast.Constant(len(self.checks) - 1)], [])
                out.append(ast.copy_location(ast.Expr(call), stmt))
        return out

    def _check_of(self, stmt):
        """(line, labels, shapes, printed text or None, is a print) of a statement whose comment states a
        result; None for any other."""
        comment = "; ".join(self.comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in self.comments)
        if not comment:
            return None
        shapes = stated_shapes(comment)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            elts = target.elts if isinstance(target, ast.Tuple) else [target]
            if shapes and all(isinstance(e, ast.Name) for e in elts):
                return stmt.lineno, [e.id for e in elts], shapes, None, False
        elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
              and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "print"):
            text = comment.rsplit(": ", 1)[1].strip() if ": " in comment else None
            if shapes or text is not None:  # the printed text, where stated, is the check (its shapes are in it)
                return stmt.lineno, [ast.unparse(a) for a in stmt.value.args], [] if text else shapes, text, True
        return None

    def namespace(self) -> dict:
        def recording_print(*args, **kwargs):
            self.printed = args
            builtins.print(*args, **kwargs)

        return {"__name__": "example", "print": recording_print, "__stated_result__": self._check}

    def where(self, lineno: int) -> str:
        return f"{self.page}:{self.first_line + lineno - 1}"

    def _check(self, index: int) -> None:
        lineno, labels, shapes, text, is_print = self.checks[index]
        self.reached.add(index)
        where = self.where(lineno)
        values = list(self.printed) if is_print else [self._namespace[label] for label in labels]
        if text is not None:
            printed = " ".join(map(_render, values))
            assert printed == text, f"{where}: prints {printed!r}, its comment says {text!r}"
        if not shapes:
            return
        if len(shapes) != 1 and len(shapes) != len(values):
            raise AssertionError(f"{where}: the comment states {len(shapes)} shapes for {len(values)} values")
        for label, value, (dtype, dims) in zip(labels, values, shapes * len(values) if len(shapes) == 1 else shapes):
            shape = tuple(value) if isinstance(value, torch.Size) else getattr(value, "shape", None)
            stated = "(" + ", ".join(map(str, dims)) + ")"
            assert shape is not None, f"{where}: `{label}` is a {type(value).__name__} without a shape; " \
                                      f"its comment says {stated}"
            shape = tuple(shape)
            bound = {d: self.symbols.setdefault(d, n) for d, n in zip(dims, shape) if isinstance(d, str)}
            expected = tuple(bound.get(d, d) if isinstance(d, str) else d for d in dims)
            symbols = f" with {', '.join(f'{d}={n}' for d, n in bound.items())}" if bound else ""
            assert shape == expected, f"{where}: `{label}` has shape {shape}, its comment says {stated}{symbols}"
            if dtype is not None:
                assert value.dtype == getattr(torch, dtype), \
                    f"{where}: `{label}` is {value.dtype}, its comment says {dtype}"

    def run(self) -> int:
        """Run the example with its checks; returns how many stated results it checked."""
        self._namespace = self.namespace()
        exec(self.code, self._namespace)
        missed = [self.where(self.checks[i][0]) for i in range(len(self.checks)) if i not in self.reached]
        assert not missed, f"stated results never reached: {', '.join(missed)}"
        return len(self.checks)


@pytest.mark.cuda  # the examples that use CUDA run on it
@pytest.mark.parametrize("page, line, code", EXAMPLES, ids=[f"{page}:{line}" for page, line, _ in EXAMPLES])
def test_example_runs(page, line, code, tmp_path, monkeypatch):
    """Each example runs, and the results its comments state (shapes, dtypes, printed values) are what it gives."""
    reason = skip_reason(code)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    StatedResults(page, line, code).run()


def test_examples_state_results_that_are_checked():
    """The comments' stated results are found where the manual gives them: the core op's output shapes, the Sana
    block's, the printed shapes of the model cards, the segmenters' logits and the mosaic's image and mask."""
    per_page = {}
    for page, line, code in EXAMPLES:
        checks = StatedResults(page, line, code).checks
        per_page[page] = per_page.get(page, 0) + len(checks)
    assert sum(per_page.values()) >= 10, per_page
    for page in ("README.md", "docs/core-op.md", "docs/diffusion.md", "docs/models/linvit.md", "docs/segmentation.md"):
        assert per_page.get(page, 0) >= 1, f"{page}: no stated result found in its examples"


@pytest.mark.parametrize("code, message", [
    ("import torch\nx = torch.zeros(2, 3)  # (2, 4)\n", r"`x` has shape \(2, 3\), its comment says \(2, 4\)"),
    ("import torch\na, b = torch.zeros(2, 3), torch.zeros(3, 3)  # (B, N)\n", r"`b` has shape \(3, 3\).*B=2"),
    ("import torch\nq = torch.zeros(2, 5)  # (B, N)\nv = torch.zeros(2, 6)  # (B, N)\n", r"`v` .* N=5"),
    ("import torch\nm = torch.zeros(2, 2)  # int64 (2, 2)\n", "`m` is torch.float32, its comment says int64"),
    ("import torch\ni, m = torch.zeros(3), torch.zeros(4)  # (3,); (4,); (5,)\n", "3 shapes for 2 values"),
    ("import torch\nprint(torch.zeros(1, 10).shape)  # any size: (1, 11)\n", "prints '\\(1, 10\\)'"),
    ("import torch\nprint(torch.zeros(1, 10).shape)  # (1, 11) for any size\n", r"has shape \(1, 10\)"),
    ("print(2 > 1, 1 > 2)  # both: True True\n", "prints 'True False', its comment says 'True True'"),
    ("x = 3  # (1, 2)\n", "`x` is a int without a shape"),
    ("import torch\nif False:\n    y = torch.zeros(1, 2)  # (1, 2)\n", "never reached: t.md:3"),
])
def test_a_result_that_contradicts_its_comment_fails(code, message, capsys):
    with pytest.raises(AssertionError, match=message):
        StatedResults("t.md", 1, code).run()


def test_results_that_agree_with_their_comments_pass(capsys):
    code = ("import torch\nq, k = torch.zeros(2, 6, 12, 4), torch.zeros(2, 6, 12, 4)  # (B, H, N, D), a grid\n"
            "o = torch.zeros(2, 6, 12, 8)  # (B, H, N, Dv), O(N) memory (cached per grid, device)\n"
            "with torch.no_grad():\n    y = o.sum(-1)  # (2, 6, 12): any N\n"
            "image, mask = torch.zeros(3, 4, 4), torch.zeros(4, 4, dtype=torch.long)  # float32 (3, 4, 4); "
            "int64 (4, 4)\nprint(o.shape[:2], o.shape[2] == 12)  # shapes: (2, 6) True\n")
    assert StatedResults("t.md", 1, code).run() == 5  # statements with a stated result
    assert capsys.readouterr().out == "torch.Size([2, 6]) True\n"


def _modules():
    """Tool module -> the console script it runs, for the modules of one command (pyproject.toml's entry points; a
    module of several commands runs none of them as ``python -m``)."""
    modules = [entry.split(":")[0] for entry in SCRIPTS.values()]
    return {entry.split(":")[0]: command for command, entry in SCRIPTS.items()
            if modules.count(entry.split(":")[0]) == 1}


LAUNCHER_FLAGS = ("-m", "--no-python", "--no_python")  # torchrun's: the module, or the program, follows


def _shell_commands(body, first):
    """(line number, console script, arguments) of every tool command line in ``body``, shell lines of which the
    first is line ``first``: the command typed, or the one a module or file of linvision/tools/ runs as ``python -m``,
    ``python FILE`` or under torchrun. Continuation lines are joined, comments dropped, and the lines' own variables
    (NAME="..." or NAME=value) substituted."""
    import shlex
    by_module = _modules()
    by_file = {f"linvision/tools/{m.rsplit('.', 1)[1]}.py": command for m, command in by_module.items()}
    found, env = [], {}
    for start, line in joined_lines(body, first):
        line = re.sub(r"\s+#.*$", "", line.strip().removeprefix("$ "))
        if not re.match(r"(linvision-|python linvision/tools/|python -m linvision|torchrun |[A-Z]\w*=)", line):
            continue
        words = shlex.split(line)
        if all(re.fullmatch(r"[A-Z]\w*=.*", w) for w in words):
            env.update(w.split("=", 1) for w in words)
            continue
        for name, value in env.items():
            line = line.replace(f"${name}", value)
        words = shlex.split(line) if line else []
        if words[:1] == ["torchrun"]:
            words = words[next(i for i, w in enumerate(words) if w in LAUNCHER_FLAGS or w.endswith(".py")):]
            words = words[1:] if words[0] in LAUNCHER_FLAGS else words
        elif words[:1] == ["python"]:
            words = words[2:] if words[1:2] == ["-m"] else words[1:]
        if not words:
            continue
        command = words[0] if words[0] in SCRIPTS else by_file.get(words[0]) or by_module.get(words[0])
        if command:
            found.append((start, command, words[1:]))
    return found


def _command_lines():
    """Every tool command line in the shell blocks of the pages: (page, line, console script, arguments)."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for first, lang, body in fenced_blocks(text):
            if lang in ("", "bash"):
                found += [(page, *command) for command in _shell_commands(body, first)]
    return found


COMMANDS = _command_lines()


def test_pages_have_command_lines():
    commands = {c for _, _, c, _ in COMMANDS}
    assert len(COMMANDS) >= 60 and {"linvision-train", "linvision-benchmark", "linvision-export",
                                    "linvision-train-diffusion"} <= commands


@pytest.mark.parametrize("page, line, command, args", COMMANDS,
                         ids=[f"{page}:{line}" for page, line, _, _ in COMMANDS])
def test_command_line_parses(page, line, command, args):
    """Each printed command line is one its tool accepts: every flag exists and every value has the right type."""
    parser = command_parser(command)
    try:
        parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{page}:{line}: `{parser.prog} {' '.join(args)}` is refused by the tool's parser (exit {e.code})")


def _help_parser(command: str, width: int = 100):
    """A tool's parser, printing its help as a terminal ``width`` columns wide does."""
    parser = command_parser(command)
    formatter_class = parser.formatter_class
    parser.formatter_class = lambda prog: formatter_class(prog, width=width)
    return parser


def _help_description(command: str) -> str:
    """The part of a tool's ``--help`` between the usage and the flags, as printed: where the examples are."""
    parser = _help_parser(command)
    full, usage = parser.format_help(), parser.format_usage()
    parser.description = None
    bare = parser.format_help()
    assert full.startswith(usage) and bare.startswith(usage) and full.endswith(bare[len(usage):])
    return full[len(usage):len(full) - len(bare) + len(usage)]


def _help_command_lines():
    """Every command line that a tool's --help prints (a line starting with linvision-... or torchrun, joined
    across continuation backslashes): (command, line, the console script it runs, arguments)."""
    found = []
    for command in SCRIPTS:
        found += [(command, *c) for c in _shell_commands(_help_description(command).split("\n"), 1)]
    return found


HELP_COMMANDS = _help_command_lines()


def test_every_help_has_examples_of_its_command():
    """Each tool's --help shows how to run it, each example on lines as typed: a command continued on the next line
    ends with a backslash (no line joined into the one before it with the backslash lost)."""
    for command in SCRIPTS:
        lines = [raw.strip() for raw in _help_description(command).split("\n")]
        assert any(line == command or line.startswith(command + " ") for line in lines), \
            f"{command} --help shows no example of {command}"
        for line in lines:
            if re.match(r"(linvision-|torchrun |python )", line):
                code = re.sub(r"\s+#.*$", "", line).rstrip("\\").rstrip()
                assert "   " not in code, f"{command} --help: an example line holds a lost line break: {line!r}"
    assert len(HELP_COMMANDS) >= 35


@pytest.mark.parametrize("command, line, runs, args", HELP_COMMANDS,
                         ids=[f"{command}-help:{line}" for command, line, _, _ in HELP_COMMANDS])
def test_help_command_line_parses(command, line, runs, args):
    """Each command line of a tool's --help is one the tool accepts (parsed only, nothing runs); a --config names a
    config shipped with linvision, whose keys are flags of the tool."""
    from linvision.utils.config import packaged_config, parse_args
    parser = command_parser(runs)
    configs = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
    for name in configs:
        assert packaged_config(name) is not None, f"{command} --help:{line}: --config {name} is not a shipped config"
    try:
        parse_args(parser, args) if configs else parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{command} --help:{line}: `{parser.prog} {' '.join(args)}` is refused by the tool's parser "
                    f"(exit {e.code})")
