"""The Python examples of README.md and of the manual (docs/**/*.md) run as printed, each in a fresh namespace and
an empty folder, and every tool command line of their shell blocks is one the tool's parser accepts.

Examples that need a GPU are skipped without one; those that load a run folder ("output/...") need a training
command first, and those that name a hub tag download weights: all three are skipped, saying which, and what they
call is checked by the kernel, tool and model tests instead."""
import glob
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                          recursive=True))


def _examples():
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        found += [(page, text[:m.start()].count("\n") + 2, m.group(1))
                  for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]
    return found


EXAMPLES = _examples()


def test_pages_have_examples():
    pages = {page for page, _, _ in EXAMPLES}
    assert "README.md" in pages and len(pages) >= 6, pages
    assert len(EXAMPLES) >= 12


def skip_reason(code: str):
    if ('"cuda"' in code or ".cuda()" in code) and not torch.cuda.is_available():
        return "needs a GPU"
    if '"output/' in code:
        return "needs a trained run folder (the training command of the same page)"
    if re.search(r'create_model\("[^"]+\.[^"]+", pretrained=True', code):
        return "downloads pretrained weights from the hub"
    return None


@pytest.mark.parametrize("page, line, code", EXAMPLES, ids=[f"{page}:{line}" for page, line, _ in EXAMPLES])
def test_example_runs(page, line, code, tmp_path, monkeypatch):
    reason = skip_reason(code)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "example"})


def _fenced_blocks(text: str):
    """(first line number, language, lines) of every fenced code block."""
    blocks, lang, body, first = [], None, [], 0
    for number, line in enumerate(text.split("\n"), 1):
        if lang is None and line.startswith("```"):
            lang, body, first = line[3:].strip(), [], number + 1
        elif lang is not None and line.strip() == "```":
            blocks.append((first, lang, body))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _scripts():
    """Console-script name -> tool module, from pyproject.toml."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return {k: v.split(":")[0] for k, v in tomllib.load(f)["project"]["scripts"].items()}


def _shell_commands(body, first):
    """(line number, tool module, arguments) of every tool command line in ``body``, shell lines of which the first
    is line ``first``. Continuation lines are joined, comments dropped, and the lines' own variables (NAME="..." or
    NAME=value) substituted."""
    import shlex
    scripts = _scripts()
    by_file = {f"tools/{m.rsplit('.', 1)[1]}.py": m for m in scripts.values()}
    by_module = {m: m for m in scripts.values()}
    found, env, pending, start = [], {}, "", 0
    for i, raw in enumerate(body):
        line = raw.rstrip()
        if not pending:
            start = first + i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        line = re.sub(r"\s+#.*$", "", line.removeprefix("$ "))
        if not re.match(r"(linvision-|python tools/|python -m linvision|torchrun |[A-Z]\w*=)", line):
            continue
        words = shlex.split(line)
        if all(re.fullmatch(r"[A-Z]\w*=.*", w) for w in words):
            env.update(w.split("=", 1) for w in words)
            continue
        for name, value in env.items():
            line = line.replace(f"${name}", value)
        words = shlex.split(line) if line else []
        if words[:1] == ["torchrun"]:
            words = words[next(i for i, w in enumerate(words) if w == "-m" or w.endswith(".py")):]
            words = words[1:] if words[0] == "-m" else words
        elif words[:1] == ["python"]:
            words = words[2:] if words[1:2] == ["-m"] else words[1:]
        if not words:
            continue
        module = scripts.get(words[0]) or by_file.get(words[0]) or by_module.get(words[0])
        if module:
            found.append((start, module, words[1:]))
    return found


def _command_lines():
    """Every tool command line in the shell blocks of the pages: (page, line, tool module, arguments)."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for first, lang, body in _fenced_blocks(text):
            if lang in ("", "bash"):
                found += [(page, *command) for command in _shell_commands(body, first)]
    return found


COMMANDS = _command_lines()


def test_pages_have_command_lines():
    modules = {m for _, _, m, _ in COMMANDS}
    assert len(COMMANDS) >= 60 and {"linvision.tools.train", "linvision.tools.benchmark", "linvision.tools.export",
                                    "linvision.tools.train_diffusion"} <= modules


@pytest.mark.parametrize("page, line, module, args", COMMANDS,
                         ids=[f"{page}:{line}" for page, line, _, _ in COMMANDS])
def test_command_line_parses(page, line, module, args):
    """Each printed command line is one its tool accepts: every flag exists and every value has the right type."""
    import importlib
    parser = importlib.import_module(module).build_parser()
    try:
        parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{page}:{line}: `{parser.prog} {' '.join(args)}` is refused by the tool's parser (exit {e.code})")


def _help_parser(module: str, width: int = 100):
    """A tool's parser, printing its help as a terminal ``width`` columns wide does."""
    import importlib
    parser = importlib.import_module(module).build_parser()
    formatter_class = parser.formatter_class
    parser.formatter_class = lambda prog: formatter_class(prog, width=width)
    return parser


def _help_description(module: str) -> str:
    """The part of a tool's ``--help`` between the usage and the flags, as printed: where the examples are."""
    parser = _help_parser(module)
    full, usage = parser.format_help(), parser.format_usage()
    parser.description = None
    bare = parser.format_help()
    assert full.startswith(usage) and bare.startswith(usage) and full.endswith(bare[len(usage):])
    return full[len(usage):len(full) - len(bare) + len(usage)]


def _help_command_lines():
    """Every command line that a tool's --help prints (a line starting with linvision-... or torchrun, joined
    across continuation backslashes): (command, line, tool module, arguments)."""
    found = []
    for command, module in _scripts().items():
        found += [(command, *c) for c in _shell_commands(_help_description(module).split("\n"), 1)]
    return found


HELP_COMMANDS = _help_command_lines()


def test_every_help_has_examples_of_its_command():
    """Each tool's --help shows how to run it, each example on lines as typed: a command continued on the next line
    ends with a backslash (no line joined into the one before it with the backslash lost)."""
    scripts = _scripts()
    for command, module in scripts.items():
        lines = [raw.strip() for raw in _help_description(module).split("\n")]
        assert any(line == command or line.startswith(command + " ") for line in lines), \
            f"{command} --help shows no example of {command}"
        for line in lines:
            if re.match(r"(linvision-|torchrun |python )", line):
                code = re.sub(r"\s+#.*$", "", line).rstrip("\\").rstrip()
                assert "   " not in code, f"{command} --help: an example line holds a lost line break: {line!r}"
    assert len(HELP_COMMANDS) >= 35


@pytest.mark.parametrize("command, line, module, args", HELP_COMMANDS,
                         ids=[f"{command}-help:{line}" for command, line, _, _ in HELP_COMMANDS])
def test_help_command_line_parses(command, line, module, args):
    """Each command line of a tool's --help is one the tool accepts (parsed only, nothing runs); a --config names a
    config shipped with linvision, whose keys are flags of the tool."""
    import importlib
    from linvision.engine.config import packaged_config, parse_args
    parser = importlib.import_module(module).build_parser()
    configs = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
    for name in configs:
        assert packaged_config(name) is not None, f"{command} --help:{line}: --config {name} is not a shipped config"
    try:
        parse_args(parser, args) if configs else parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{command} --help:{line}: `{parser.prog} {' '.join(args)}` is refused by the tool's parser "
                    f"(exit {e.code})")
