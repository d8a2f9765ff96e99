"""NaFlex throughput on a mixed-aspect workload (``linvision-bench-naflex``, linvision/tools/bench_naflex.py): linvit (linear
attention) against timm's naflexvit (softmax attention) and against linvit on square images of the same token
count, at sequence budgets (patches per image).

The workload (:func:`workload`): batches of noise images of random aspect ratio and size, the same at every budget,
each made a NaFlex batch by timm's functions at a budget (:func:`naflex_batch`). :func:`measure` gives one row (a
model on one input kind at one budget and mode; a failure or an out-of-memory error is recorded in the row, never
raised); :func:`run_sweep` runs every series at every budget under the guards of :class:`SweepConfig` (a softmax
model skipped where its attention matrix passes the memory limit, a model slower than ``slow_factor`` times the
reference timed once and not run at larger budgets); :func:`table`, :func:`limits`, :func:`plot` and the CSV
functions present the rows. Imports training/ and below."""
from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from linvision.benchmark.plots import series_styles
from linvision.benchmark.throughput import free_memory, parse_model_spec, runs_phrase, timing
from linvision.utils.measure import MemoryMeter, timed
from linvision.utils.amp import autocast
from linvision.utils.factory import check_model_name, create_model

DEFAULT_BUDGETS = (256, 1024, 4096, 16384)
SOFTMAX_TINY = "naflexvit_tiny_patch16"
# a name of the benchmark for a timm model with options: (timm name, options under --model-kwargs and the spec's own)
ALIASES = {
    SOFTMAX_TINY: ("naflexvit_base_patch16_gap",
                   dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, reg_tokens=0, class_token=True,
                        global_pool="token", fc_norm=False, init_values=None)),
}
DEFAULT_MODELS = ("linvit_tiny_patch16_224", "linvit_tiny_patch16_rope_224", SOFTMAX_TINY)
MODES = ("infer", "train")
DTYPES = {"float32": "none", "bfloat16": "bf16"}  # --dtype -> the autocast choice of linvision.utils.amp
FIELDS = ("model", "input", "budget", "mode", "batch", "seq_len", "tokens_per_image", "fill_pct", "images_per_s",
          "images_per_s_min", "images_per_s_max", "ms", "ms_min", "ms_max", "spread_pct", "iters", "peak_mib",
          "time_vs_ref", "attn_matrix_mib", "params_m", "status", "reason", "device", "dtype", "threads")
NOT_RUN = ("skipped", "oom", "error")  # statuses without figures
STOPS = ("skipped", "oom", "slow")  # statuses after which a model is not run at larger budgets


@dataclass
class SweepConfig:
    """What a sweep measures and how (the flags of linvision-bench-naflex, checked)."""
    models: List[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    square: List[str] = field(default_factory=lambda: ["linvit_tiny_patch16_224"])
    reference: Optional[str] = None  # one of models; None: the first
    common_kwargs: Dict[str, Any] = field(default_factory=dict)
    budgets: Sequence[int] = DEFAULT_BUDGETS
    modes: Sequence[str] = ("infer",)
    batch: int = 4
    batches: int = 2
    seed: int = 0
    min_side: int = 128
    max_side: int = 1536
    max_aspect: float = 3.0
    device: str = "cpu"
    dtype: str = "float32"
    warmup: int = 1
    iters: int = 3
    memory_limit_gib: float = 16.0
    slow_factor: float = 10.0
    max_run_s: Optional[float] = None
    output: str = "naflex_results.csv"

    def __post_init__(self):
        self.reference = self.reference or self.models[0]


def parse_budgets(values: Sequence[Any]) -> List[int]:
    """``["256", "1024,4096"]`` -> [256, 1024, 4096]: positive integers, each once, in increasing order;
    ValueError in one line for anything else."""
    budgets = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part.isdigit() or int(part) < 1:
                raise ValueError(f"budgets: {part or value!r} is not a positive whole number of patches per image "
                                 f"(e.g. --budgets 256 1024 4096 16384)")
            budgets.append(int(part))
    if not budgets:
        raise ValueError("budgets: none given")
    return sorted(set(budgets))


def resolve_spec(spec: str, common: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
    """(timm name, options) of a model spec (``name`` or ``name:key=value,...``; an alias of :data:`ALIASES`
    expands to its timm name, its options under ``common`` and the spec's own); ValueError in one line for an
    unknown name or a malformed option."""
    name, own = parse_model_spec(spec)
    base, defaults = ALIASES.get(name, (name, {}))
    if name not in ALIASES:
        try:
            check_model_name(base)
        except ValueError as e:
            raise ValueError(f"{e}; or {', '.join(ALIASES)}") from None
    return base, {**defaults, **(common or {}), **own}


# --- the workload


def image_sizes(count: int, seed: int = 0, min_side: int = 128, max_side: int = 1536,
                max_aspect: float = 3.0) -> List[Tuple[int, int]]:
    """(height, width) of ``count`` images: aspect ratio log-uniform in [1 / max_aspect, max_aspect], the longer
    side uniform in the pixels that keep the shorter one at ``min_side`` or more, up to ``max_side``; the shorter
    side is rounded up, so that the ratio of the two stays within ``max_aspect``."""
    if not (1 <= min_side and min_side * max_aspect <= max_side and max_aspect >= 1):
        raise ValueError(f"min_side/max_side/max_aspect: need 1 <= min side and min side x max aspect <= max side, "
                         f"got {min_side}, {max_side}, {max_aspect}")
    g = torch.Generator().manual_seed(seed)
    sizes = []
    for _ in range(count):
        log_ratio = (2 * torch.rand((), generator=g).item() - 1) * math.log(max_aspect)  # log(width / height)
        stretch = math.exp(abs(log_ratio))
        low = math.ceil(min_side * stretch - 1e-9)
        longer = low + int(torch.randint(0, max_side - low + 1, (), generator=g))
        shorter = min(longer, max(min_side, math.ceil(longer / stretch - 1e-9)))
        sizes.append((shorter, longer) if log_ratio >= 0 else (longer, shorter))
    return sizes


def make_images(sizes: Sequence[Tuple[int, int]], seed: int = 0) -> List[torch.Tensor]:
    """Uniform noise images (3, H, W) in [0, 1) of the given sizes, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.rand(3, h, w, generator=g) for h, w in sizes]


def naflex_batch(images: Sequence[torch.Tensor], patch_size: Tuple[int, int], budget: int) -> Dict[str, torch.Tensor]:
    """timm's NaFlex batch of ``images`` at ``budget`` patches per image: each resized to fit (its aspect ratio
    kept; timm's ResizeToSequence), patchified (Patchify) and collated (NaFlexCollator, padded to the budget).
    Returns the collator's dict: patches (B, budget, P*P*C), patch_coord (B, budget, 2) as (y, x), patch_valid
    (B, budget) and seq_len."""
    from timm.data.naflex_dataset import NaFlexCollator
    from timm.data.naflex_transforms import Patchify, ResizeToSequence

    resize = ResizeToSequence(patch_size=patch_size, max_seq_len=budget, interpolation="bicubic")
    patchify = Patchify(patch_size)
    batch, _ = NaFlexCollator(max_seq_len=budget)([(patchify(resize(im)), 0) for im in images])
    return batch


def workload(batch: int, batches: int, seed: int = 0, min_side: int = 128, max_side: int = 1536,
             max_aspect: float = 3.0) -> List[List[torch.Tensor]]:
    """``batches`` lists of ``batch`` source images (:func:`image_sizes`, :func:`make_images`), the same at every
    budget."""
    sizes = image_sizes(batch * batches, seed, min_side, max_side, max_aspect)
    images = make_images(sizes, seed)
    return [images[i * batch:(i + 1) * batch] for i in range(batches)]


def square_side(budget: int) -> int:
    """Patches a side of the square baseline at ``budget``: the largest square grid within it."""
    return math.isqrt(budget)


# --- the models


def patch_size_of(model: torch.nn.Module) -> Tuple[int, int]:
    if hasattr(model, "get_patch_size"):
        size = model.get_patch_size()
    else:
        size = model.patch_embed.patch_size
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    return int(size[0]), int(size[1])


def softmax_heads(model: torch.nn.Module) -> Optional[int]:
    """The most heads of a softmax attention layer of ``model`` (timm's Attention or AttentionRope, linvision's
    softmax mixer), None when it has none (linear attention)."""
    from timm.layers import Attention, AttentionRope

    from linvision.layers.mixers import SoftmaxAttention

    heads = [int(m.num_heads) for m in model.modules() if isinstance(m, (Attention, AttentionRope, SoftmaxAttention))]
    return max(heads) if heads else None


def attention_matrix_bytes(batch: int, heads: int, tokens: int, itemsize: int) -> int:
    """Bytes of one attention matrix: batch x heads x tokens^2 elements."""
    return batch * heads * tokens * tokens * itemsize


# --- one point


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e)))


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def empty_row(spec: str, input_kind: str, budget: int, mode: str, cfg: SweepConfig) -> Dict[str, Any]:
    nan = float("nan")
    row = {key: nan for key in FIELDS}
    row.update(model=spec, input=input_kind, budget=budget, mode=mode, batch=cfg.batch, iters=0, status="ok",
               reason="", device=cfg.device, dtype=cfg.dtype, threads=torch.get_num_threads())
    return row


def _inputs(name: str, kwargs: Dict[str, Any], input_kind: str, budget: int, cfg: SweepConfig,
            images: List[List[torch.Tensor]], cache: Dict[Any, Any], row: Dict[str, Any]):
    """(model, batches) of a point on the CPU; fills the row's sequence figures."""
    torch.manual_seed(cfg.seed)
    if input_kind == "square":
        side = square_side(budget)
        # the patch size, from a model at its default size, gives the image size of the budget's grid
        ph, pw = patch_size_of(create_model(name, model_kwargs=dict(kwargs, num_classes=0)))
        torch.manual_seed(cfg.seed)
        model = create_model(name, model_kwargs=kwargs, img_size=(side * ph, side * pw))
        g = torch.Generator().manual_seed(cfg.seed)
        inputs = [torch.rand(cfg.batch, 3, side * ph, side * pw, generator=g) for _ in range(cfg.batches)]
        row.update(seq_len=side * side, tokens_per_image=float(side * side), fill_pct=100.0 * side * side / budget)
        return model, inputs
    model = create_model(name, model_kwargs=kwargs)
    key = (patch_size_of(model), budget)
    if key not in cache:
        cache.clear()  # one budget's batches at a time
        cache[key] = [naflex_batch(b, key[0], budget) for b in images]
    inputs = cache[key]
    valid = torch.stack([b["patch_valid"] for b in inputs]).float()
    row.update(seq_len=budget, tokens_per_image=valid.sum(-1).mean().item(), fill_pct=100.0 * valid.mean().item())
    return model, inputs


def _over_memory_limit(model: torch.nn.Module, cfg: SweepConfig, row: Dict[str, Any]) -> bool:
    """Whether a softmax model's projected attention matrix passes the memory limit (then the row says so)."""
    heads = softmax_heads(model)
    if heads is None:
        return False
    tokens = row["seq_len"] + getattr(model, "num_prefix_tokens", 0)
    itemsize = 4 if cfg.dtype == "float32" else 2
    projected = attention_matrix_bytes(cfg.batch, heads, tokens, itemsize)
    row["attn_matrix_mib"] = projected / 2**20
    if projected <= cfg.memory_limit_gib * 2**30:
        return False
    row.update(status="skipped", reason=(
        f"projected attention matrix {projected / 2**30:.3g} GiB ({cfg.batch} x {heads} heads x "
        f"{tokens}^2 x {itemsize} B) > --memory-limit-gib {cfg.memory_limit_gib:g}"))
    return True


def _runner(model: torch.nn.Module, inputs: List[Any], mode: str, dev: torch.device, amp: str) -> Callable[[], None]:
    """One pass of ``mode`` on the next batch (the passes go round ``inputs``)."""
    turn = [0]

    def next_input():
        x = inputs[turn[0] % len(inputs)]
        turn[0] += 1
        return x

    if mode == "infer":
        model.eval()

        def run():
            with torch.inference_mode(), autocast(dev, amp):
                model(next_input())
        return run
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        with autocast(dev, amp):
            loss = model(next_input()).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _runs(run: Callable[[], None], dev: torch.device, cfg: SweepConfig, ref_ms: Optional[float]):
    """(times, done, slow, long): the timed runs the figures come from, the first one or two runs, whether the
    point is slow against the reference and whether its first run passed ``max_run_s``."""
    def over(seconds: float) -> bool:
        return ref_ms is not None and seconds * 1e3 > cfg.slow_factor * ref_ms

    done = timed(run, dev, 0, 1)
    long = cfg.max_run_s is not None and done[0] > cfg.max_run_s
    if over(done[0]) and not long:  # the first run may pay one-time costs: a second one confirms
        done += timed(run, dev, 0, 1)
        long = cfg.max_run_s is not None and done[-1] > cfg.max_run_s
    slow = over(done[-1])
    if slow or long:
        times = done[-1:]
    elif cfg.warmup == 0:  # the runs done are timed ones
        times = done + timed(run, dev, 0, max(cfg.iters - len(done), 0))
    else:
        times = timed(run, dev, max(cfg.warmup - len(done), 0), cfg.iters)
    return times, done, slow, long


def _record(row: Dict[str, Any], times: List[float], done: List[float], slow: bool, long: bool, peak_mib: float,
            cfg: SweepConfig, ref_ms: Optional[float]) -> None:
    fig = timing("t", times, cfg.batch)
    row.update(images_per_s=fig["t_img_s"], images_per_s_min=fig["t_img_s_min"],
               images_per_s_max=fig["t_img_s_max"], ms=fig["t_ms"], ms_min=fig["t_ms_min"],
               ms_max=fig["t_ms_max"], spread_pct=fig["t_spread_pct"], iters=len(times), peak_mib=peak_mib)
    if ref_ms is not None:
        row["time_vs_ref"] = row["ms"] / ref_ms
    if slow:
        row.update(status="slow", reason=f"{'first' if len(done) == 1 else 'second'} run {done[-1]:.3g} s = "
                                         f"{done[-1] * 1e3 / ref_ms:.1f}x the reference's median (> "
                                         f"--slow-factor {cfg.slow_factor:g}); timed once")
    elif long:
        row["reason"] = f"one run: it took {done[-1]:.3g} s > --max-run-s {cfg.max_run_s:g}"


def measure(spec: str, input_kind: str, budget: int, mode: str, cfg: SweepConfig, images: List[List[torch.Tensor]],
            ref_ms: Optional[float], cache: Dict[Any, Any]) -> Dict[str, Any]:
    """One row: ``spec`` (a model spec) on ``input_kind`` ("naflex" or "square") batches at ``budget`` in
    ``mode``; never raises for a failure of the model or an out-of-memory error. ``ref_ms``: the reference's
    median at this point, for the slow guard and time_vs_ref. ``cache``: the NaFlex batches of one budget."""
    row = empty_row(spec, input_kind, budget, mode, cfg)
    dev = torch.device(cfg.device)
    model = inputs = None
    try:
        name, kwargs = resolve_spec(spec, cfg.common_kwargs)
        model, inputs = _inputs(name, kwargs, input_kind, budget, cfg, images, cache, row)
        row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        if _over_memory_limit(model, cfg, row):
            return row
        model.to(dev)
        inputs = [{k: v.to(dev) if torch.is_tensor(v) else v for k, v in b.items()} if isinstance(b, dict)
                  else b.to(dev) for b in inputs]
        run = _runner(model, inputs, mode, dev, DTYPES[cfg.dtype])
        with MemoryMeter(dev) as mem:
            times, done, slow, long = _runs(run, dev, cfg, ref_ms)
        _record(row, times, done, slow, long, mem.peak_mb, cfg, ref_ms)
    except Exception as e:  # a point's failure is recorded and the sweep goes on
        row.update(status="oom" if _is_oom(e) else "error", reason=_one_line(e))
    finally:
        del model, inputs
        free_memory(dev)
    return row


# --- the sweep, the table, the plot


def series(cfg: SweepConfig) -> List[Tuple[str, str]]:
    """(spec, input) of every series, the reference first."""
    naflex = [cfg.reference] + [m for m in cfg.models if m != cfg.reference]
    return [(m, "naflex") for m in naflex] + [(m, "square") for m in cfg.square]


def run_sweep(cfg: SweepConfig, log: Callable[[str], Any] = print) -> List[Dict[str, Any]]:
    """Every series at every budget, mode by mode (inference first); the CSV rewritten after each point."""
    images = workload(cfg.batch, cfg.batches, cfg.seed, cfg.min_side, cfg.max_side, cfg.max_aspect)
    rows: List[Dict[str, Any]] = []
    cache: Dict[Any, Any] = {}
    all_series = series(cfg)
    total = len(cfg.modes) * len(cfg.budgets) * len(all_series)
    for mode in cfg.modes:
        stopped: Dict[Tuple[str, str], str] = {}
        for budget in cfg.budgets:
            ref_ms = None
            for spec, kind in all_series:
                if (spec, kind) in stopped:
                    row = empty_row(spec, kind, budget, mode, cfg)
                    row.update(status="skipped", reason=stopped[(spec, kind)])
                else:
                    is_ref = (spec, kind) == (cfg.reference, "naflex")
                    row = measure(spec, kind, budget, mode, cfg, images, None if is_ref else ref_ms, cache)
                    if is_ref and row["status"] == "ok":
                        ref_ms = row["ms"]
                        row["time_vs_ref"] = 1.0
                    if row["status"] in STOPS:
                        why = {"skipped": "over the memory limit", "oom": "out of memory",
                               "slow": f"{row['time_vs_ref']:.1f}x the reference's time"}[row["status"]]
                        stopped[(spec, kind)] = f"{why} at budget {budget}: larger budgets not run"
                rows.append(row)
                write_csv(rows, cfg.output)
                log(f"[{len(rows)}/{total}] {format_row(row)}")
    return rows


def _cell(value: Any, fmt: str) -> str:
    return f"{value:{fmt}}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def format_row(row: Dict[str, Any]) -> str:
    head = f"{row['mode']:<5} budget {row['budget']:>6} {row['model']} [{row['input']}]"
    if row["status"] in NOT_RUN:
        return f"{head}: {row['status']}: {row['reason']}"
    line = (f"{head}: {row['images_per_s']:.3g} img/s, {row['ms']:.1f} ms per batch (spread "
            f"{row['spread_pct']:.0f}%, {runs_phrase(row['iters'])}), peak {row['peak_mib']:.0f} MiB, "
            f"{row['tokens_per_image']:.0f} of {row['seq_len']} tokens per image")
    if math.isfinite(row["time_vs_ref"]):
        line += f", {row['time_vs_ref']:.2f}x the reference's time"
    return line + (f"; {row['status']}: {row['reason']}" if row["reason"] else "")


INT_FIELDS = ("budget", "batch", "seq_len", "iters", "threads")
TEXT_FIELDS = ("model", "input", "mode", "status", "reason", "device", "dtype")


def read_csv(path: str) -> List[Dict[str, Any]]:
    """The rows of a CSV of :func:`write_csv`, typed as the sweep made them (an empty figure is NaN);
    ValueError in one line for a file without this tool's columns."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in FIELDS if k not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"from_csv: {path} is not a CSV of linvision-bench-naflex (no {', '.join(missing)})")
        rows = []
        for raw in reader:
            row: Dict[str, Any] = {}
            for key in FIELDS:
                value = raw[key]
                if key in TEXT_FIELDS:
                    row[key] = value
                elif key in INT_FIELDS:
                    row[key] = int(value) if value else 0
                else:
                    row[key] = float(value) if value else float("nan")
            rows.append(row)
    if not rows:
        raise ValueError(f"from_csv: {path} holds no rows")
    return rows


def plot_title(rows: List[Dict[str, Any]], cfg: SweepConfig) -> str:
    """The plot's title: how the rows were measured and the workload."""
    r = rows[0]
    threads = f"{r['threads']} thread{'s' if r['threads'] != 1 else ''}"
    return (f"{r['device']} ({threads}), {r['dtype']}, batch {r['batch']}; NaFlex mixed aspect "
            f"1:{cfg.max_aspect:g}-{cfg.max_aspect:g}:1, {cfg.min_side}-{cfg.max_side} px")


def write_csv(rows: List[Dict[str, Any]], path: str) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) and math.isfinite(v) else
                                 "" if isinstance(v, float) else v) for k, v in row.items()})


def table(rows: List[Dict[str, Any]]) -> str:
    """A markdown table of the rows."""
    head = ["mode", "budget", "model", "input", "tokens/img", "images/s", "ms/batch", "peak MiB", "x ref time",
            "status"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|---|" + "---:|" * 5 + "---|"]
    for r in rows:
        status = f"{r['status']}: {r['reason']}" if r["reason"] else r["status"]
        lines.append("| " + " | ".join([
            r["mode"], str(r["budget"]), r["model"], r["input"], _cell(r["tokens_per_image"], ".0f"),
            _cell(r["images_per_s"], ".3g"), _cell(r["ms"], ".0f"), _cell(r["peak_mib"], ".0f"),
            _cell(r["time_vs_ref"], ".2f"), status]) + " |")
    return "\n".join(lines)


def limits(rows: List[Dict[str, Any]], reference: str, slow_factor: float) -> List[str]:
    """Per other series and mode: the first budget where it did not fit (skipped, out of memory) or took more than
    ``slow_factor`` times the reference's time, or that it did neither."""
    out = []
    for spec, kind, mode in dict.fromkeys((r["model"], r["input"], r["mode"]) for r in rows):
        if (spec, kind) == (reference, "naflex"):
            continue
        own = [r for r in rows if (r["model"], r["input"], r["mode"]) == (spec, kind, mode)]
        where = next((r for r in own if r["status"] in ("skipped", "oom") or
                      (math.isfinite(r["time_vs_ref"]) and r["time_vs_ref"] > slow_factor)), None)
        label = f"{mode}: {spec} [{kind}]"
        if where is None:
            worst = max((r["time_vs_ref"] for r in own if math.isfinite(r["time_vs_ref"])), default=float("nan"))
            out.append(f"{label}: fits and stays within {slow_factor:g}x the reference's time at every budget "
                       f"(at most {_cell(worst, '.2f')}x)")
        elif where["status"] in ("skipped", "oom"):
            out.append(f"{label}: does not fit from budget {where['budget']} ({where['status']}: {where['reason']})")
        else:
            out.append(f"{label}: more than {slow_factor:g}x the reference's time from budget {where['budget']} "
                       f"({where['time_vs_ref']:.1f}x)")
    return out


def plot(rows: List[Dict[str, Any]], path: str, title: str = "") -> bool:
    """PNG of images/s and peak memory against the budget (log axes), a row of two panels per mode; points not
    measured are an x at the bottom of their panel. False when nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    measured = [r for r in rows if r["status"] not in NOT_RUN and math.isfinite(r["images_per_s"])]
    if not measured:
        return False
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    labels = list(dict.fromkeys(f"{r['model']} [{r['input']}]" for r in rows))
    styles = dict(zip(labels, series_styles(len(labels))))
    budgets = sorted({r["budget"] for r in rows})
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 3.6 * len(modes) + 1.4), squeeze=False)
    names = {"infer": "inference", "train": "training step"}
    for i, mode in enumerate(modes):
        for j, (key, what) in enumerate((("images_per_s", "images/s"), ("peak_mib", "peak memory (MiB)"))):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            for label in labels:
                own = [r for r in measured if r["mode"] == mode and f"{r['model']} [{r['input']}]" == label
                       and math.isfinite(r[key]) and r[key] > 0]
                if own:
                    ax.plot([r["budget"] for r in own], [r[key] for r in own], ms=5, label=label, **styles[label])
                    slow = [r for r in own if r["status"] == "slow"]
                    ax.plot([r["budget"] for r in slow], [r[key] for r in slow], "o", ms=11, mfc="none",
                            color=styles[label]["color"])
            ax.autoscale_view()
            bottom, top = ax.get_ylim()
            for label in labels:
                missed = [r["budget"] for r in rows if r["mode"] == mode and r["status"] in NOT_RUN
                          and f"{r['model']} [{r['input']}]" == label]
                if missed:
                    ax.plot(missed, [bottom] * len(missed), "x", color=styles[label]["color"], ms=9, clip_on=False)
            ax.set_ylim(bottom, top)
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0), numticks=12))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.tick_params(labelsize=8)
            ax.set_xlabel("budget (most patches per image)", fontsize=9)
            ax.set_title(f"{names[mode]}: {what}", fontsize=10)
            ax.grid(True, which="major", alpha=0.3)
    handles = [Line2D([], [], ms=5, label=label, **styles[label]) for label in labels]
    if any(r["status"] in NOT_RUN for r in rows):
        handles.append(Line2D([], [], marker="x", color="0.35", linestyle="none", ms=8,
                              label="not run (over the memory limit, out of memory, after a slow point, error)"))
    if any(r["status"] == "slow" for r in rows):
        handles.append(Line2D([], [], marker="o", mfc="none", color="0.35", linestyle="none", ms=10,
                              label="slow: one run only (over --slow-factor x the reference)"))
    runs = sorted({int(r["iters"]) for r in measured})
    fig.suptitle("\n".join(filter(None, [title, f"images/s: {runs_phrase(runs)} per point; memory: peak added by a "
                                                "pass"])), fontsize=10)
    legend_rows = math.ceil(len(handles) / 2)
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, (0.2 + 0.2 * legend_rows) / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
