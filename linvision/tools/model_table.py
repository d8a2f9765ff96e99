r"""Params / GFLOPs of every registered linvision model, and what pretrained=True loads, as a Markdown table.

    linvision-model-table                                   # measure, print the full table (at 224 x 224)
    linvision-model-table --size 512 --filter "mlla*"
    linvision-model-table --json docs/models.json           # measure and store: the manual's table and cards
    linvision-model-table --from-json docs/models.json --style front   # README's table, nothing measured

GFLOPs are multiply-accumulates of one forward pass of one image (see linvision.benchmark.flops); the column without
attention leaves out the products of two activations (batched matmuls, SDPA), as papers that count convolutions
and projections only do. Measuring builds every model (a minute or two on a CPU); --from-json renders stored rows.
"""
import argparse
import json
import os
import re
from typing import Dict, List, Optional, Sequence

import timm
import torch

import linvision
from linvision.utils.cli import tool_parser
from linvision.utils.files import atomic_write_text
from linvision.benchmark.flops import count_gflops, count_params

DEFAULT_FILTER = ("inline*", "lin*", "mavit*", "mlla*", "pola*", "ravlt*", "vig*")
COMMAND = "linvision-model-table --json docs/models.json"
# the first matching prefix names the family
FAMILIES = (("linvit_", "linvit"), ("linhier_delta_", "linhier (delta rule)"), ("linhier_gcnn_", "linhier (Gated CNN)"),
            ("linhier_", "linhier"), ("mavit_", "MAViT"), ("mlla_", "MLLA"), ("ravlt_", "RAVLT"), ("vig_h_", "ViG-H"),
            ("vig_", "ViG"), ("inline_deit_", "InLine-DeiT"), ("inline_swin_", "InLine-Swin"), ("inline_cswin_", "InLine-CSwin"),
            ("inline_pvt_", "InLine-PVT"), ("pola_swin_", "Pola-Swin"), ("pola_pvt_", "Pola-PVT"))
UNTRAINED_USE = {  # what each family without trained weights is for, in README's line about them
    "linhier (delta rule)": "the bidirectional delta rule in every stage",
    "linhier": "linear attention with 2D RoPE in every stage",
    "linhier (Gated CNN)": "MambaOut's Gated CNN, no token mixer: the baseline of ablations",
    "linvit": "isotropic ViTs; `.deit_fb_in1k` loads DeiT's softmax weights as the start of linearization",
}
FRONT_ORDER = ("MLLA", "RAVLT", "MAViT", "InLine-Swin", "InLine-CSwin", "InLine-PVT", "Pola-Swin", "Pola-PVT",
               "ViG-H", "InLine-DeiT", "ViG", "linhier (delta rule)", "linhier", "linhier (Gated CNN)",
               "linvit")  # trained first


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-model-table."""
    parser = tool_parser("linvision-model-table", __doc__)
    parser.add_argument("--size", type=int, default=224, help="square input side in pixels (default 224)")
    parser.add_argument("--filter", nargs="+", default=list(DEFAULT_FILTER),
                        help="timm name patterns (default: every linvision family)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the measured rows to FILE (JSON), as docs/models.json holds them")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="render the rows stored in FILE instead of measuring (--size and --filter ignored)")
    parser.add_argument("--style", default="full", choices=["full", "front"],
                        help="full: mixers, params, GFLOPs with and without attention, weights; front: README's "
                             "table (family, params, GFLOPs, weights, published top-1)")
    return parser


def measure(names: Sequence[str], size: int = 224) -> List[Dict]:
    """One row per model: its token mixers, params (M) and GFLOPs at ``size``, with and without attention."""
    rows = []
    for name in names:
        torch.manual_seed(0)
        kwargs = {}
        if name.startswith(("linvit", "inline_deit")):  # the isotropic models: their own embedding (InLine-DeiT's at
            # 288 and 448 px counted as loaded), resampled to ``size``
            kwargs = dict(dynamic_img_size=True, img_size=timm.models.get_pretrained_cfg(name).input_size[-1])
        model = timm.create_model(name, **kwargs)
        rows.append(dict(model=name, mixers=_mixers(model), size=size, params_m=round(count_params(model) / 1e6, 1),
                         gflops=round(count_gflops(model, size), 2),
                         gflops_no_attention=round(count_gflops(model, size, attention=False), 2)))
    return rows


def read_rows(path: str) -> List[Dict]:
    """The rows a ``--json`` run stored; a missing or malformed file is a ValueError naming it."""
    try:
        with open(path) as f:
            rows = json.load(f)["models"]
        for r in rows:
            missing = {"model", "mixers", "size", "params_m", "gflops", "gflops_no_attention"} - set(r)
            if missing:
                raise KeyError(", ".join(sorted(missing)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a model table written by `{COMMAND}` ({type(e).__name__}: {e})") from None
    return rows


def full_table(rows: List[Dict]) -> str:
    size = rows[0]["size"] if rows else 224
    lines = [f"| model | token mixers | params (M) | GFLOPs @ {size} | without attention | pretrained=True loads |",
             "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['mixers']} | {r['params_m']:.1f} | {r['gflops']:.2f} | "
              f"{r['gflops_no_attention']:.2f} | {weights_text(r['model'])} |" for r in rows]
    return "\n".join(lines)


def front_table(rows: List[Dict]) -> str:
    """README's table: the models with trained weights, then one paragraph naming the others by family."""
    size = rows[0]["size"] if rows else 224
    lines = [f"| model | params (M) | GFLOPs @ {size} | `pretrained=True` loads | published top-1 |",
             "|---|---:|---:|---|---:|"]
    trained = [r for r in rows if _has_weights(r["model"])]
    for r in sorted(trained, key=lambda r: (_family_order(r["model"]), r["params_m"])):
        cfg = timm.models.get_pretrained_cfg(r["model"])
        top1 = published_top1(r["model"])
        lines.append(f"| `{r['model']}.{cfg.tag}` | {r['params_m']:.1f} | {r['gflops']:.2f} | "
                     f"{cfg.description.split(' (')[0]} | {'—' if top1 is None else f'{top1:.1f}'} |")
    rest: Dict[str, List[str]] = {}
    for r in sorted(rows, key=lambda r: (_family_order(r["model"]), r["params_m"])):
        if not _has_weights(r["model"]):
            rest.setdefault(family(r["model"]), []).append(f"`{r['model']}`")
    if rest:
        parts = [f"{label}: {', '.join(names)} ({UNTRAINED_USE[label]})" for label, names in rest.items()]
        lines += ["", "Without trained weights, to train from scratch (`pretrained=True` is an error naming the "
                      "models above): " + "; ".join(parts) + "."]
    return "\n".join(lines)


def _has_weights(name: str) -> bool:
    """Trained weights: a source timm downloads, or published ones loaded from a local copy (a published top-1
    recorded, no address: Pola-Swin)."""
    cfg = timm.models.get_pretrained_cfg(name)
    return bool(cfg is not None and (cfg.has_weights or published_top1(name) is not None))


def family(name: str) -> str:
    return next(label for prefix, label in FAMILIES if name.startswith(prefix))


def _family_order(name: str) -> int:
    return FRONT_ORDER.index(family(name))


def published_top1(name: str) -> Optional[float]:
    """The published ImageNet-1k top-1 the model's pretrained config records in its notes, or None."""
    cfg = timm.models.get_pretrained_cfg(name)
    for note in (cfg.notes or ()) if cfg is not None else ():
        m = re.match(r"published ImageNet-1k top-1 ([\d.]+)", note)
        if m:
            return float(m.group(1))
    return None


def weights_text(name: str) -> str:
    cfg = timm.models.get_pretrained_cfg(name)
    if _has_weights(name):
        return f"`.{cfg.tag}`: {cfg.description}"
    tagged = [timm.models.get_pretrained_cfg(t) for t in timm.list_pretrained(f"{name}.*")]
    return "an error (no trained weights)" + "".join(f"; `.{c.tag}` loads {c.description}" for c in tagged)


def _mixers(model) -> str:
    mixers = list(getattr(model, "token_mixers", None) or [model.token_mixer])
    text = f"{mixers[0]} x{len(mixers)}" if len(mixers) > 1 and len(set(mixers)) == 1 else ",".join(mixers)
    return text + (f" ({model.rope} RoPE)" if getattr(model, "rope", None) else "")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if args.from_json:
        rows = read_rows(args.from_json)
    else:
        rows = measure(timm.list_models(args.filter), args.size)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            atomic_write_text(args.json, json.dumps(dict(command=COMMAND, models=rows), indent=1) + "\n")
    print((front_table if args.style == "front" else full_table)(rows))


if __name__ == "__main__":
    main()
