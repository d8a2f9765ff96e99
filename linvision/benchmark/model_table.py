"""Params / GFLOPs of every registered linvision model and what ``pretrained=True`` loads, as Markdown tables
(``linvision-model-table``; the manual's model table and README's, docs/models.json).

:func:`measure` builds each model and counts its parameters and its GFLOPs at a size
(:mod:`linvision.benchmark.flops`: multiply-accumulates of one forward pass of one image; the count without
attention leaves out the products of two activations), its token mixers, and the input
``timm.create_model(name)`` takes with no other argument (:func:`input_multiple`: any multiple of the model's
stride, found by running it at two small non-square sizes, or only the size it was built for). Every model is
built on the meta device (shapes without weights or arithmetic: a CPU run's counts and refusals, in a second or
so a model).
:func:`write_rows` stores the rows, :func:`read_rows` reads them back; :func:`full_table` renders a row per
model, :func:`front_table` README's row per family (:data:`FAMILIES`), trained families first.
"""
import json
import os
import re
from typing import Dict, List, Optional, Sequence

import timm
import torch

import linvision  # noqa: F401  (registers the models)
from linvision.utils.files import atomic_write_text

from .flops import count_gflops_split, count_params

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


def claim_sizes(multiple: int) -> List[tuple]:
    """The (height, width) at which :func:`input_multiple` tries a model of stride ``multiple``: two small
    non-square multiples of it."""
    return [(2 * multiple, 3 * multiple), (3 * multiple, 2 * multiple)]


def input_multiple(name: str, device: str = "meta", model: Optional[torch.nn.Module] = None) -> Optional[int]:
    """The stride (the last feature map's reduction) when ``timm.create_model(name)``, with no other argument,
    runs at the sizes of :func:`claim_sizes` (any multiple of it, as the docs claim); None when it takes only the
    size it was built for. On the meta device (the default) the shapes alone are computed, which is where a size
    is refused; a forward that needs values there raises instead of answering. ``model``: that model already
    built on ``device`` (else it is built here)."""
    if model is None:
        torch.manual_seed(0)
        with torch.device(device):
            model = timm.create_model(name)
    model = model.eval()
    stride = model.feature_info[-1]["reduction"]
    try:
        with torch.no_grad():
            for h, w in claim_sizes(stride):
                model(torch.randn(1, 3, h, w, device=device))
    except (AssertionError, RuntimeError, ValueError) as e:  # timm's patch embedding asserts its size
        if "meta tensor" in str(e):  # the meta device has no values to give (Tensor.item()): not a size refusal
            raise
        return None
    return stride


def measure(names: Sequence[str], size: int = 224) -> List[Dict]:
    """One row per model: its token mixers, params (M) and GFLOPs at ``size``, with and without attention, and
    :func:`input_multiple`; each model is built on the meta device (the counts need shapes only)."""
    rows = []
    for name in names:
        torch.manual_seed(0)
        kwargs = {}
        if name.startswith(("linvit", "inline_deit")):  # the isotropic models: their own embedding (InLine-DeiT's at
            # 288 and 448 px counted as loaded), resampled to ``size``
            kwargs = dict(dynamic_img_size=True, img_size=timm.models.get_pretrained_cfg(name).input_size[-1])
        with torch.device("meta"):
            model = timm.create_model(name, **kwargs)
        gflops, no_attention = count_gflops_split(model, size)
        rows.append(dict(model=name, mixers=_mixers(model), size=size, params_m=round(count_params(model) / 1e6, 1),
                         gflops=round(gflops, 2), gflops_no_attention=round(no_attention, 2),
                         input_multiple=input_multiple(name, model=None if kwargs else model)))
    return rows


def read_rows(path: str) -> List[Dict]:
    """The rows a ``--json`` run stored; a missing or malformed file is a ValueError naming it."""
    try:
        with open(path) as f:
            rows = json.load(f)["models"]
        for r in rows:
            missing = {"model", "mixers", "size", "params_m", "gflops", "gflops_no_attention", "input_multiple"} - set(r)
            if missing:
                raise KeyError(", ".join(sorted(missing)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a model table written by `{COMMAND}` ({type(e).__name__}: {e})") from None
    return rows


def write_rows(path: str, rows: List[Dict]) -> None:
    """Store ``rows`` in ``path`` (JSON, with the command that writes docs/models.json), as :func:`read_rows`
    reads them."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps(dict(command=COMMAND, models=rows), indent=1) + "\n")


def full_table(rows: List[Dict]) -> str:
    size = rows[0]["size"] if rows else 224
    lines = [f"| model | token mixers | params (M) | GFLOPs @ {size} | without attention | input | "
             f"pretrained=True loads |", "|---|---|---:|---:|---:|---|---|"]
    lines += [f"| {r['model']} | {r['mixers']} | {r['params_m']:.1f} | {r['gflops']:.2f} | "
              f"{r['gflops_no_attention']:.2f} | {input_text(r)} | {weights_text(r['model'])} |" for r in rows]
    return "\n".join(lines)


def input_text(row: Dict) -> str:
    """What ``timm.create_model(row's model)`` takes with no other argument."""
    if row["input_multiple"]:
        return f"any multiple of {row['input_multiple']}"
    side = timm.models.get_pretrained_cfg(row["model"]).input_size[-1]
    return f"{side} px (`dynamic_img_size=True`: any multiple of 16)"


def front_table(rows: List[Dict]) -> str:
    """README's table: one row per family, trained ones first: its models (the family's name prefix and each
    model's rest), params, the input ``timm.create_model(name)`` takes, what ``pretrained=True`` loads and the
    published top-1 (their ranges over the family)."""
    lines = ["| family | models | params (M) | input | `pretrained=True` loads | published top-1 |",
             "|---|---|---:|---|---|---:|"]
    by_family: Dict[str, List[Dict]] = {}
    for r in sorted(rows, key=lambda r: (_family_order(r["model"]), r["params_m"])):
        by_family.setdefault(family(r["model"]), []).append(r)
    for label, members in by_family.items():
        prefix = next(p for p, name in FAMILIES if name == label)
        params = _span([r["params_m"] for r in members], ".1f")
        weighted = [r for r in members if _has_weights(r["model"])]
        cfg = timm.models.get_pretrained_cfg(weighted[0]["model"]) if weighted else None
        loads = f"{cfg.description.split(' (')[0]} (`.{cfg.tag}`)" if cfg else f"none: {UNTRAINED_USE[label]}"
        lines.append(f"| {label} | {_family_names(prefix, members)} | {params} | {_family_input(prefix, members)} | "
                     f"{loads} | {_family_top1(prefix, members)} |")
    return "\n".join(lines)


def _size_and_variant(rest: str) -> tuple:
    """A model name without its family prefix as (size, the rest): ``tiny_patch16_rope_224`` -> ("tiny",
    "patch16_rope_224"), ``tiny`` -> ("tiny", "")."""
    size, _, variant = rest.partition("_")
    return size, variant


def _variants(prefix: str, members: List[Dict]) -> Dict[str, List[str]]:
    """Each variant of a family (a name's rest after its size) -> its sizes, in the members' order."""
    out: Dict[str, List[str]] = {}
    for r in members:
        size, variant = _size_and_variant(r["model"][len(prefix):])
        out.setdefault(variant, []).append(size)
    return out


def _family_names(prefix: str, members: List[Dict]) -> str:
    """The models column: the prefix and each model's rest (``mlla_`` tiny, small, base); a family of several
    variants of the same sizes in brace notation instead, with the variants not made at every size after it
    (```linvit_{tiny,small,base}_patch16{,_pola,_rope}_224```, ```linvit_small_patch16_rope_mixed_224```)."""
    variants = _variants(prefix, members)
    if len(variants) < 2:
        return f"`{prefix}` " + ", ".join(r["model"][len(prefix):] for r in members)
    sizes = list(dict.fromkeys(_size_and_variant(r["model"][len(prefix):])[0] for r in members))
    full = [v for v, at in variants.items() if at == sizes]
    if len(full) < 2:
        return f"`{prefix}` " + ", ".join(r["model"][len(prefix):] for r in members)
    parts = [v.split("_") for v in full]
    lead = 0
    while all(len(p) > lead + 1 and p[lead] == parts[0][lead] for p in parts):
        lead += 1
    trail = 0
    while all(len(p) >= lead + trail + 1 and p[-1 - trail] == parts[0][-1 - trail] for p in parts):
        trail += 1
    head, tail = parts[0][:lead], parts[0][len(parts[0]) - trail:]
    middles = ["".join("_" + t for t in p[lead:len(p) - trail]) for p in parts]
    pattern = (f"`{prefix}{{{','.join(sizes)}}}" + "".join("_" + t for t in head) + f"{{{','.join(middles)}}}"
               + "".join("_" + t for t in tail) + "`")
    others = [f"`{prefix}{size}_{v}`" for v, at in variants.items() if v not in full for size in at]
    return ", ".join([pattern] + others)


def _family_top1(prefix: str, members: List[Dict]) -> str:
    """The published top-1 column: the range over the family, with the models it was published for named when
    it was not for every one (MAViT's 84.7 is the small model's)."""
    known = [(r["model"][len(prefix):], published_top1(r["model"])) for r in members]
    known = [(rest, t) for rest, t in known if t is not None]
    if not known:
        return "—"
    text = _span([t for _, t in known], ".1f")
    return text if len(known) == len(members) else f"{text} ({', '.join(rest for rest, _ in known)})"


def _span(values: List[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return f"{low:{fmt}}" if f"{low:{fmt}}" == f"{high:{fmt}}" else f"{low:{fmt}}-{high:{fmt}}"


def _family_input(prefix: str, members: List[Dict]) -> str:
    """The input of a family's models: the multiple they share, and those that take only their own size (named
    by their variant, ```*_patch16_224```, where every size of that variant does)."""
    multiples = sorted({r["input_multiple"] for r in members if r["input_multiple"]})
    fixed = [r for r in members if not r["input_multiple"]]
    text = " or ".join(f"any multiple of {m}" for m in multiples)
    if fixed:
        text += (f"; {_which(prefix, members, fixed)}: {input_text(fixed[0])}" if text
                 else input_text(fixed[0]))
    return text


def _which(prefix: str, members: List[Dict], some: List[Dict]) -> str:
    """``some`` of a family's models, named by their variants where they hold every size of them."""
    variants = _variants(prefix, members)
    chosen = {r["model"] for r in some}
    names, covered = [], set()
    for variant, sizes in variants.items():
        models = {f"{prefix}{size}_{variant}" if variant else f"{prefix}{size}" for size in sizes}
        if variant and len(sizes) > 1 and models <= chosen:
            names.append(f"`*_{variant}`")
            covered |= models
    names += [r["model"] for r in some if r["model"] not in covered]
    return ", ".join(names)


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
