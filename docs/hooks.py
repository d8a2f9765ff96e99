"""MkDocs hooks: the parts of the manual generated from the code when the site is built.

A page asks for one with a marker line:

- ``<!-- flags: linvision-train -->``: the command's usage and a table of every flag, from its argument parser
  (the parser the command itself runs: ``build_parser()`` of its module in ``linvision.tools``, or the one the
  module's ``PARSERS`` names where it holds several commands);
- ``<!-- model-table -->``: params, GFLOPs and what ``pretrained=True`` loads for every registered model, from
  ``docs/models.json`` (written by ``linvision-model-table --json docs/models.json``);
- ``<!-- model-cards: PATTERN -->``: a card per model whose timm name matches PATTERN, from its pretrained config
  and ``docs/models.json``.

A marker naming an unknown command or matching no model fails the build. Every generated cell is Markdown whose
text outside code spans has ``&``, ``<`` and ``>`` escaped, so a placeholder such as ``torch/<name>`` prints as
written instead of vanishing as an unknown HTML tag.

The hooks also render the formulas: ``$...$`` and ``$$...$$`` (pymdownx.arithmatex, generic mode) become MathML
with latex2mathml when the page is built, so the manual needs neither a network nor JavaScript to show them.
"""
import argparse
import fnmatch
import html
import importlib
import os
import re
import textwrap
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- (flags|model-table|model-cards)(?::\s*(\S+))? -->$", re.M)


def _scripts() -> dict:
    """Console-script name -> tool module, from pyproject.toml."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


def _parser(command: str, module: str) -> argparse.ArgumentParser:
    """The parser that ``command`` runs: ``module``'s build_parser(), or in a module of several commands the one its
    PARSERS names."""
    tool = importlib.import_module(module)
    parsers = getattr(tool, "PARSERS", None)
    return parsers[command]() if parsers is not None else tool.build_parser()


CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _escape(text: str) -> str:
    """HTML-escape ``&``, ``<`` and ``>`` outside Markdown code spans (inside them Markdown escapes them itself)."""
    out, pos = [], 0
    for m in CODE_SPAN.finditer(text):
        out += [html.escape(text[pos:m.start()], quote=False), m.group(0)]
        pos = m.end()
    return "".join(out + [html.escape(text[pos:], quote=False)])


def _cell(text) -> str:
    return _escape(str(text).replace("|", "\\|").replace("\n", " "))


def _default(action: argparse.Action) -> str:
    if action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0:
        return ""
    value = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
    return f"`{value}`" if str(value) != "" else "`''`"


USAGE_WIDTH = 96  # columns of the printed usage: the code block fits the content column of a 1400 px window


def _usage(parser: argparse.ArgumentParser) -> str:
    """The parser's usage as a terminal USAGE_WIDTH columns wide prints it, a list of choices too long for a line
    shown by the flag's name (the table below lists the choices)."""
    for action in parser._actions:
        if action.choices is not None and action.metavar is None and len(",".join(map(str, action.choices))) > 40:
            action.metavar = action.dest.upper()
    formatter = parser.formatter_class(prog=parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help()


def flags_table(command: str) -> str:
    scripts = _scripts()
    if command not in scripts:
        raise ValueError(f"docs: flags marker names {command!r}, not a command of pyproject.toml "
                         f"({', '.join(sorted(scripts))})")
    parser = _parser(command, scripts[command])
    rows = ["| flag | default | what it sets |", "|---|---|---|"]
    usage = textwrap.dedent(" " * 7 + _usage(parser).strip().removeprefix("usage: "))
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
        helptext = action.help or ""
        if action.choices is not None:
            helptext += f" (one of: {', '.join(map(str, action.choices))})"
        rows.append(f"| {names} | {_cell(_default(action))} | {_cell(helptext)} |")
    return (f"```\n{usage}\n```\n\nGenerated from the command's own parser when this manual is built "
            f"(`{command} --help` prints the same flags).\n\n" + "\n".join(rows) + "\n")


def _models() -> list:
    from linvision.benchmark.model_table import read_rows
    return read_rows(os.path.join(ROOT, "docs", "models.json"))


TAG_LOADS = re.compile(r"; `\.([\w-]+)` loads (.+?) \|$")


def model_table() -> str:
    """The table of every model. A tag's description that repeats down the last column (the same weights for
    every model of a family) is printed once under the table, and the cells name the tag."""
    from linvision.benchmark.model_table import COMMAND, full_table
    lines, notes = [], {}
    for line in full_table(_models()).splitlines():
        m = TAG_LOADS.search(line)
        if m:
            notes.setdefault(m.group(1), m.group(2))
            line = line[:m.start()] + f"; `.{m.group(1)}`: see below |"
        lines.append(_escape(line))
    below = "".join(f"\n`.{tag}` loads {_escape(text)}." for tag, text in notes.items())
    return (f"Made by `{COMMAND}` (stored in `docs/models.json`):\n\n" + "\n".join(lines) + "\n"
            + (f"\n{below.strip()}\n" if below else ""))


def model_cards(pattern: str) -> str:
    import timm
    from linvision.benchmark.model_table import COMMAND, published_top1, weights_text
    rows = [r for r in _models() if fnmatch.fnmatch(r["model"], pattern)]
    if not rows:
        raise ValueError(f"docs: model-cards marker {pattern!r} matches no model in docs/models.json")
    out = []
    for r in rows:
        cfg = timm.models.get_pretrained_cfg(r["model"])
        source = f"[{cfg.origin_url}]({cfg.origin_url})" if cfg.origin_url else "linvision"
        paper = f"{cfg.paper_name} ({cfg.paper_ids})" if cfg.paper_name else "—"
        top1 = published_top1(r["model"])
        out += [f"### `{r['model']}`", "", '<div class="model-card" markdown="1">', "",
                "| | |", "|---|---|",
                f"| token mixers | {_cell(r['mixers'])} |",
                f"| params | {r['params_m']:.1f} M |",
                f"| GFLOPs @ {r['size']} | {r['gflops']:.2f} ({r['gflops_no_attention']:.2f} without attention) |",
                f"| input | {cfg.input_size[1]} x {cfg.input_size[2]}, crop_pct {cfg.crop_pct}, "
                f"{'fixed size' if cfg.fixed_input_size else 'any size the stride divides'} |",
                f"| source | {source} |", f"| paper | {_cell(paper)} |",
                f"| licence | {_cell(cfg.license or '—')} |",
                f"| `pretrained=True` loads | {_cell(weights_text(r['model']))} |",
                f"| published ImageNet-1k top-1 | {top1 if top1 is not None else '—'} |", "", "</div>", ""]
    out.append(f"Params and GFLOPs made by `{COMMAND}`; the rest is the model's pretrained config.")
    return "\n".join(out) + "\n"


def on_page_markdown(markdown, page, config, files):
    def replace(m):
        kind, arg = m.group(1), m.group(2)
        if kind == "flags":
            return flags_table(arg)
        if kind == "model-table":
            return model_table()
        return model_cards(arg)
    return MARKER.sub(replace, markdown)


MATH = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)


def _mathml(m, page) -> str:
    from latex2mathml.converter import convert
    block = m.group(1) == "div"
    tex = html.unescape(m.group(2)).strip()
    opener, closer = (r"\[", r"\]") if block else (r"\(", r"\)")
    if not (tex.startswith(opener) and tex.endswith(closer)):
        raise ValueError(f"docs: {page}: unexpected math markup {m.group(0)[:80]!r}")
    tex = tex[2:-2].strip()
    try:
        mathml = convert(tex, display="block" if block else "inline")
    except Exception as e:
        raise ValueError(f"docs: {page}: latex2mathml cannot convert {tex!r}: {e!r}") from e
    unknown = re.findall(r"\\[A-Za-z]+", mathml)  # a command latex2mathml does not know is printed as written
    if unknown:
        raise ValueError(f"docs: {page}: latex2mathml does not know {', '.join(unknown)} in {tex!r}")
    return f'<div class="math">{mathml}</div>' if block else mathml


CELL = re.compile(r"<td[^>]*>.*?</td>", re.S)


def _unbroken(cell: str) -> str:
    """A table cell's "mean ± spread" kept on one line (a narrow column would break it at both spaces)."""
    return cell.replace(" \u00b1 ", "&nbsp;\u00b1&nbsp;")


def on_page_content(html_text, page, config, files):
    name = getattr(getattr(page, "file", None), "src_uri", page)
    return CELL.sub(lambda m: _unbroken(m.group(0)), MATH.sub(lambda m: _mathml(m, name), html_text))
