"""MkDocs hooks: the parts of the manual generated from the code when the site is built.

A page asks for one with a marker line:

- ``<!-- flags: linvision-train -->``: the command's usage and a table of every flag, from its argument parser
  (``linvision.tools.<tool>.build_parser()``, the parser the command itself runs);
- ``<!-- model-table -->``: params, GFLOPs and what ``pretrained=True`` loads for every registered model, from
  ``docs/models.json`` (written by ``linvision-model-table --json docs/models.json``);
- ``<!-- model-cards: PATTERN -->``: a card per model whose timm name matches PATTERN, from its pretrained config
  and ``docs/models.json``.

A marker naming an unknown command or matching no model fails the build.
"""
import argparse
import fnmatch
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


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0:
        return ""
    value = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
    return f"`{value}`" if str(value) != "" else "`''`"


def flags_table(command: str) -> str:
    scripts = _scripts()
    if command not in scripts:
        raise ValueError(f"docs: flags marker names {command!r}, not a command of pyproject.toml "
                         f"({', '.join(sorted(scripts))})")
    parser = importlib.import_module(scripts[command]).build_parser()
    usage = textwrap.dedent(" " * 7 + parser.format_usage().strip().removeprefix("usage: "))
    rows = ["| flag | default | what it sets |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
        helptext = action.help or ""
        if action.choices is not None:
            helptext += f" (one of: {', '.join(map(str, action.choices))})"
        rows.append(f"| {names} | {_cell(_default(action))} | {_cell(helptext)} |")
    return (f"```\n{usage}\n```\n\nGenerated from the command's own parser when this manual is built "
            f"(`{command} --help` prints the same).\n\n" + "\n".join(rows) + "\n")


def _models() -> list:
    from linvision.tools.model_table import read_rows
    return read_rows(os.path.join(ROOT, "docs", "models.json"))


def model_table() -> str:
    from linvision.tools.model_table import COMMAND, full_table
    return f"Made by `{COMMAND}` (stored in `docs/models.json`):\n\n" + full_table(_models()) + "\n"


def model_cards(pattern: str) -> str:
    import timm
    from linvision.tools.model_table import COMMAND, published_top1, weights_text
    rows = [r for r in _models() if fnmatch.fnmatch(r["model"], pattern)]
    if not rows:
        raise ValueError(f"docs: model-cards marker {pattern!r} matches no model in docs/models.json")
    out = []
    for r in rows:
        cfg = timm.models.get_pretrained_cfg(r["model"])
        source = f"[{cfg.origin_url}]({cfg.origin_url})" if cfg.origin_url else "linvision"
        paper = f"{cfg.paper_name} ({cfg.paper_ids})" if cfg.paper_name else "—"
        top1 = published_top1(r["model"])
        out += [f"### `{r['model']}`", "",
                "| | |", "|---|---|",
                f"| token mixers | {_cell(r['mixers'])} |",
                f"| params | {r['params_m']:.1f} M |",
                f"| GFLOPs @ {r['size']} | {r['gflops']:.2f} ({r['gflops_no_attention']:.2f} without attention) |",
                f"| input | {cfg.input_size[1]} x {cfg.input_size[2]}, crop_pct {cfg.crop_pct}, "
                f"{'fixed size' if cfg.fixed_input_size else 'any size the stride divides'} |",
                f"| source | {source} |", f"| paper | {_cell(paper)} |",
                f"| licence | {_cell(cfg.license or '—')} |",
                f"| `pretrained=True` loads | {_cell(weights_text(r['model']))} |",
                f"| published ImageNet-1k top-1 | {top1 if top1 is not None else '—'} |", ""]
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
