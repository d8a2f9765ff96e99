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
    if '"cuda"' in code and not torch.cuda.is_available():
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


def _command_lines():
    """Every tool command line in the shell blocks of the pages: (page, line, tool module, arguments). Continuation
    lines are joined, comments dropped, and the block's own variables (NAME="..." or NAME=value) substituted."""
    import shlex
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = {k: v.split(":")[0] for k, v in tomllib.load(f)["project"]["scripts"].items()}
    by_file = {f"tools/{m.rsplit('.', 1)[1]}.py": m for m in scripts.values()}
    by_module = {m: m for m in scripts.values()}
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for first, lang, body in _fenced_blocks(text):
            if lang not in ("", "bash"):
                continue
            env, pending, start = {}, "", 0
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
                    found.append((page, start, module, words[1:]))
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
