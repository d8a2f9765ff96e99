"""Throughput and memory of one Sana-style block, ReLU linear self-attention against softmax self-attention, and
of the whole Sana transformer in linvision against diffusers' ``SanaTransformer2DModel``
(``linvision-bench-diffusion-block``).

:func:`run_sweep` measures each (self-attention, token count) point in a process of its own
(:func:`measure`, through :func:`linvision.utils.measure.run_in_process`), so an out-of-memory or a time-out is
recorded for that point and the others still run. A point (:func:`measure_point`) builds one block of a
:data:`~linvision.diffusion.model.DIT_CONFIGS` shape (cross-attention to ``context`` condition tokens, Mix-FFN) on
the most square grid of the token count (:func:`grid_for`) and times ``repeats`` forwards under no_grad after one
warm-up forward (from 16k tokens on: one cold forward, no warm-up); it records the mean time, tokens per second
and the peak memory the forwards add (:class:`linvision.utils.measure.MemoryMeter`).

:func:`compare_diffusers` builds diffusers' model with random weights for a caption config, converts them into
linvision's (:mod:`linvision.diffusion.sana`) with the exact (diffusers) eps and with linvision's default eps,
and times forwards of each (after a warm-up; interleaved) on the same latents, timestep and a caption whose last
third is padding; it records the agreement of the outputs. It needs diffusers.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from linvision.utils.measure import MemoryMeter, run_in_process, timed

from .block import SanaBlock
from .model import DIT_CONFIGS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the options of a point, as the JSON of a sweep records them
OPTION_KEYS = ("model", "batch", "context", "dtype", "repeats", "threads", "device", "parts")


def grid_for(tokens: int) -> Tuple[int, int]:
    """The most square H x W with H * W = tokens."""
    h = int(math.isqrt(tokens))
    while tokens % h:
        h -= 1
    return h, tokens // h


def _block_and_inputs(opts: Dict[str, Any], attn: str, tokens: int):
    """The block of ``opts["model"]``'s shape with ``attn`` self-attention, and its inputs at ``tokens`` tokens."""
    device, dtype = opts["device"], DTYPES[opts["dtype"]]
    cfg = DIT_CONFIGS[opts["model"]]
    block = SanaBlock(cfg.dim, cfg.num_heads, head_dim=cfg.head_dim, mlp_ratio=cfg.mlp_ratio, self_attn=attn,
                      fp16_clamp=dtype == torch.float16).to(device=device, dtype=dtype).eval()
    batch, context = opts["batch"], opts["context"]
    x = torch.randn(batch, tokens, cfg.dim, device=device, dtype=dtype)
    t_mod = torch.randn(batch, 6 * cfg.dim, device=device, dtype=dtype) * 0.1
    cond = torch.randn(batch, context, cfg.dim, device=device, dtype=dtype)
    mask = torch.ones(batch, context, dtype=torch.bool, device=device)
    return block, x, t_mod, cond, mask


def measure_point(opts: Dict[str, Any], attn: str, tokens: int) -> Dict[str, Any]:
    """One point in this process: the mean time of ``opts["repeats"]`` forwards (one from 16k tokens on), tokens
    per second and peak memory; with ``opts["parts"]`` also the self-attention and the Mix-FFN alone, on a
    layer-normed input (``self_attn_ms``, ``ffn_ms``)."""
    torch.set_num_threads(opts["threads"] or torch.get_num_threads())
    torch.manual_seed(0)
    block, x, t_mod, context, mask = _block_and_inputs(opts, attn, tokens)
    hw = grid_for(tokens)
    repeats = 1 if tokens >= 16384 else opts["repeats"]
    device = torch.device(opts["device"])
    with torch.no_grad():
        with MemoryMeter(device) as mem:  # large points run once, cold: their own time dwarfs the first-call set-up
            times = timed(lambda: block(x, hw, t_mod, context, mask), device, int(repeats > 1), repeats)
        seconds = sum(times) / repeats
        parts = {}
        if opts["parts"]:
            h = block.norm1(x)
            for name, fn in (("self_attn_ms", lambda: block.attn(h, hw)), ("ffn_ms", lambda: block.ffn(h, hw))):
                parts[name] = 1e3 * sum(timed(fn, device, 0, repeats)) / repeats
    return {"attn": attn, "tokens": tokens, "grid": list(hw), "status": "ok", "ms": 1e3 * seconds,
            "tokens_per_s": opts["batch"] * tokens / seconds, "peak_mib": mem.peak_mb, "repeats": repeats, **parts}


def _point_child(conn, opts: Dict[str, Any], attn: str, tokens: int) -> None:
    conn.send(measure_point(opts, attn, tokens))
    conn.send(None)
    conn.close()


def measure(opts: Dict[str, Any], attn: str, tokens: int, timeout: float) -> Dict[str, Any]:
    """:func:`measure_point` in a process of its own, stopped after ``timeout`` seconds; a point that did not
    finish has the status of why (a time-out, the out-of-memory killer, the exit code of an error)."""
    ended = run_in_process(_point_child, (opts, attn, tokens), timeout)
    if ended.done:
        return ended.last
    if ended.timed_out:
        status = f"timeout > {timeout:.0f}s"
    else:  # a process killed by the kernel's OOM killer exits with -9; a CUDA OOM raises inside the child
        status = "out of memory (killed)" if ended.exitcode == -9 else f"failed (exit code {ended.exitcode})"
    return {"attn": attn, "tokens": tokens, "status": status}


def describe(opts: Dict[str, Any]) -> str:
    """The first line of a sweep: the block's shape and how it runs."""
    cfg = DIT_CONFIGS[opts["model"]]
    threads = opts["threads"] or torch.get_num_threads()
    return (f"block C={cfg.dim}, linear heads {cfg.dim // cfg.head_dim} x {cfg.head_dim}, cross heads "
            f"{cfg.num_heads}, Mix-FFN hidden {int(cfg.dim * cfg.mlp_ratio)}; batch {opts['batch']}, "
            f"{opts['context']} condition tokens, {opts['dtype']}, device {opts['device']}, {threads} threads")


TABLE_HEADER = f"{'attention':>9} {'tokens':>7} {'grid':>9} {'ms':>10} {'tokens/s':>10} {'peak MiB':>9}  status"


def format_point(r: Dict[str, Any]) -> str:
    """A point's line under :data:`TABLE_HEADER`."""
    if r["status"] != "ok":
        return f"{r['attn']:>9} {r['tokens']:>7} {'':>9} {'-':>10} {'-':>10} {'-':>9}  {r['status']}"
    grid = "x".join(map(str, r["grid"]))
    parts = "".join(f", {k[:-3]} {r[k]:.1f} ms" for k in ("self_attn_ms", "ffn_ms") if k in r)
    return (f"{r['attn']:>9} {r['tokens']:>7} {grid:>9} {r['ms']:>10.1f} {r['tokens_per_s']:>10.0f} "
            f"{r['peak_mib']:>9.0f}  ok{parts}")


def run_sweep(opts: Dict[str, Any], tokens: Sequence[int], attns: Sequence[str], timeout: float,
              log: Callable[[str], Any] = print) -> List[Dict[str, Any]]:
    """:func:`measure` at every token count for every self-attention, each point's line logged as it finishes."""
    results = []
    for n in tokens:
        for attn in attns:
            results.append(measure(opts, attn, n, timeout))
            log(format_point(results[-1]))
    return results


def ratios(results: List[Dict[str, Any]], tokens: Sequence[int]) -> List[str]:
    """For each token count where both were measured: linear attention's speed and peak memory against softmax's."""
    lines = []
    for n in tokens:
        pair = {r["attn"]: r for r in results if r["tokens"] == n and r["status"] == "ok"}
        if "linear" in pair and "softmax" in pair:
            lines.append(f"{n:>7} tokens: linear is {pair['softmax']['ms'] / pair['linear']['ms']:.2f}x the speed "
                         f"of softmax, {pair['linear']['peak_mib'] / max(pair['softmax']['peak_mib'], 1e-9):.2f}x "
                         f"its peak memory")
    return lines


def _sana_pair(model: str, dtype: torch.dtype, device: str):
    """diffusers' config of ``model``, diffusers' transformer with random weights, and linvision's with those
    weights, {"exact eps": ..., "default eps": ...}."""
    import diffusers

    from .model import LinDiT
    from .sana import config_from_diffusers, config_to_diffusers, state_dict_from_diffusers

    config = config_to_diffusers(DIT_CONFIGS[model])
    torch.manual_seed(0)
    theirs = diffusers.SanaTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    theirs = theirs.to(device=device, dtype=dtype).eval()
    ours = {}
    for name, exact in (("exact eps", True), ("default eps", False)):
        cfg = config_from_diffusers(config, exact_eps=exact)
        m = LinDiT(cfg)
        m.load_state_dict(state_dict_from_diffusers(theirs.state_dict(), cfg))
        ours[name] = m.to(device=device, dtype=dtype).eval()
    return config, theirs, ours


def _sana_runs(config: Dict[str, Any], theirs, ours, latent: Sequence[int], batch: int, context: int,
               dtype: torch.dtype, device: str) -> Dict[str, Callable[[], torch.Tensor]]:
    """A forward of each model on the same latents, timestep and caption (its last third padding)."""
    g = torch.Generator().manual_seed(1)
    h, w = latent
    x = torch.randn(batch, config["in_channels"], h, w, generator=g).to(device, dtype)
    t = torch.full((batch,), 0.5)
    cond = torch.randn(batch, context, config["caption_channels"], generator=g).to(device, dtype)
    mask = torch.ones(batch, context, dtype=torch.bool)
    mask[:, context - context // 3:] = False
    mask = mask.to(device)
    return {
        "diffusers": lambda: theirs(x, cond, (1000.0 * t).to(device), encoder_attention_mask=mask.long(),
                                    return_dict=False)[0],
        **{f"linvision ({n})": (lambda m=m: m(x, t.to(device), context=cond, context_mask=mask))
           for n, m in ours.items()},
    }


def compare_diffusers(model: str, latent: Sequence[int], batch: int = 1, context: int = 300, dtype: str = "fp32",
                      device: str = "cpu", repeats: int = 3, threads: Any = None) -> Dict[str, Any]:
    """Time and agree linvision's Sana transformer with diffusers' on the same random weights and inputs: the mean
    and fastest of ``repeats`` interleaved forwards of each after a warm-up (``ms``, ``min_ms``), and the
    agreement of linvision's outputs with diffusers' (``agreement``: max abs, relative L2)."""
    if threads:
        torch.set_num_threads(threads)
    config, theirs, ours = _sana_pair(model, DTYPES[dtype], device)
    runs = _sana_runs(config, theirs, ours, latent, batch, context, DTYPES[dtype], device)
    result = {"model": model, "latent": list(latent), "batch": batch, "context": context, "dtype": dtype,
              "device": device, "threads": torch.get_num_threads(),
              "params_m": sum(p.numel() for p in theirs.parameters()) / 1e6, "ms": {}, "agreement": {}}
    outputs, times = {}, {name: [] for name in runs}
    with torch.no_grad():
        for name, fn in runs.items():
            outputs[name] = fn().float()  # warm-up
        for _ in range(repeats):  # interleaved, so that load from other processes hits all alike
            for name, fn in runs.items():
                times[name] += [1e3 * s for s in timed(fn, device, 0, 1)]
    result["ms"] = {name: sum(v) / len(v) for name, v in times.items()}
    result["min_ms"] = {name: min(v) for name, v in times.items()}
    ref = outputs["diffusers"]
    for name in ours:
        out = outputs[f"linvision ({name})"]
        result["agreement"][name] = {"max_abs": (out - ref).abs().max().item(),
                                     "rel_l2": ((out - ref).norm() / ref.norm()).item(),
                                     "ref_max_abs": ref.abs().max().item()}
    return result


def comparison_text(result: Dict[str, Any], repeats: int) -> str:
    """What :func:`compare_diffusers` found, in lines: the setting, each model's time, linvision's agreement."""
    h, w = result["latent"]
    lines = [f"{result['model']}: {result['params_m']:.0f}M parameters, latents {h}x{w}, batch {result['batch']}, "
             f"{result['context']} caption tokens ({result['context'] // 3} padded), {result['dtype']}, "
             f"{result['device']}, {result['threads']} threads, mean of {repeats} interleaved forwards after a "
             f"warm-up"]
    lines += [f"  {name:>24}: {ms:9.1f} ms (fastest {result['min_ms'][name]:.1f} ms)"
              for name, ms in result["ms"].items()]
    lines += [f"  linvision ({name}) vs diffusers: max abs {a['max_abs']:.3g}, relative L2 {a['rel_l2']:.3g} "
              f"(outputs up to {a['ref_max_abs']:.3g})" for name, a in result["agreement"].items()]
    return "\n".join(lines)
