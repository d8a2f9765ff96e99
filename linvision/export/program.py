"""Exporting a model for deployment: a ``torch.export`` program or an ONNX file with dynamic batch, height and
width, checked against eager PyTorch, and timed next to it (ONNX Runtime's CPU provider).

What a model allows comes from its timm input config: a model whose ``fixed_input_size`` is set (the linvit with a
learned absolute position embedding) exports with a dynamic batch only; every other model with height and width
any multiple of its stride (the largest feature reduction: 16 for linvit, 32 for the hierarchical families). The
RoPE tables are computed from the grid inside the graph.

An exported graph holds the PyTorch path of every op: linvision's fused Triton kernels are not part of it (export
the model on the CPU; a model on CUDA exports the same graph, since ``backend="auto"`` takes PyTorch while a graph
is exported, and says so once).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from linvision.utils.files import atomic_write

__all__ = ["FORMATS", "input_constraints", "check_size", "fixed_grid", "dynamic_shapes", "export_program",
           "save_program", "export_onnx", "load_exported", "compare_with_eager", "time_runner"]

FORMATS = ("onnx", "pt2")
MAX_SIDE = 8192  # the largest height or width an exported graph accepts
MAX_BATCH = 1024


def input_constraints(model: nn.Module) -> Tuple[int, Optional[Tuple[int, int]]]:
    """(stride, fixed (H, W) or None): the multiple every side must be, and the only size a fixed-size model takes."""
    stride = max(info["reduction"] for info in model.feature_info)
    try:  # timm >= 1.0.2x: the model's own size (a linvit built with img_size=96 is fixed to 96, not its cfg's 224)
        from timm.models import get_model_input_config

        cfg = get_model_input_config(model)
    except ImportError:
        cfg = getattr(model, "pretrained_cfg", None) or {}
    fixed = tuple(cfg.get("input_size", (3, 224, 224))[1:]) if cfg.get("fixed_input_size") else None
    return stride, fixed


def check_size(model: nn.Module, size: Tuple[int, int], what: str = "img_size") -> None:
    """ValueError in one line unless the model takes (H, W) (a multiple of its stride, or its fixed size)."""
    stride, fixed = input_constraints(model)
    if fixed is not None and tuple(size) != fixed:
        raise ValueError(f"{what}: {size[0]}x{size[1]}, but this model takes only {fixed[0]}x{fixed[1]} (its "
                         f"position embedding is fixed; build it with dynamic_img_size=True for other sizes)")
    if any(s < stride or s % stride for s in size) or max(size) > MAX_SIDE:
        raise ValueError(f"{what}: {size[0]}x{size[1]}; sides must be multiples of {stride} up to {MAX_SIDE}")


def fixed_grid(model: nn.Module) -> bool:
    """Whether an exported graph of ``model`` holds for its traced size only: a mixer with ``exports_fixed_grid``
    (a window attention whose window count, padding and shift follow the input size, which torch.export cannot
    keep symbolic: Swin's shifted windows, CSWin's stripes). Such a model exports with a dynamic batch."""
    return any(getattr(m, "exports_fixed_grid", False) for m in model.modules())


def dynamic_shapes(model: nn.Module, dynamic: bool = True):
    """``dynamic_shapes`` for ``torch.export`` / ``torch.onnx.export`` of a model taking one image batch: batch,
    and height and width as multiples of the stride unless the model has a fixed size or a fixed grid
    (:func:`fixed_grid`). None when not dynamic."""
    if not dynamic:
        return None
    from torch.export import Dim

    stride, fixed = input_constraints(model)
    dims = {0: Dim("batch", min=1, max=MAX_BATCH)}
    if fixed is None and not fixed_grid(model):
        dims[2] = stride * Dim("height", min=1, max=MAX_SIDE // stride)
        dims[3] = stride * Dim("width", min=1, max=MAX_SIDE // stride)
    return (dims,)


def _example(model: nn.Module, size: Tuple[int, int]) -> Tensor:
    # batch 2: torch.export treats a size of 1 as a constant, so a dynamic batch needs another example
    in_chans = getattr(model, "in_chans", 3)
    return torch.randn(2, in_chans, *size, generator=torch.Generator().manual_seed(0))


def export_program(model: nn.Module, size: Tuple[int, int], dynamic: bool = True):
    """``torch.export.export`` of the model in eval mode on a (2, C, H, W) example."""
    check_size(model, size)
    return torch.export.export(model.eval(), (_example(model, size),), dynamic_shapes=dynamic_shapes(model, dynamic))


def export_onnx(model: nn.Module, size: Tuple[int, int], path: str, dynamic: bool = True) -> None:
    """An ONNX file of the model (torch.onnx's dynamo exporter; input "image", output "logits"), written as one
    unit (a killed export leaves no partial file)."""
    check_size(model, size)
    program = torch.onnx.export(
        model.eval(), (_example(model, size),), dynamo=True, dynamic_shapes=dynamic_shapes(model, dynamic),
        input_names=["image"], output_names=["logits"], verbose=False,
    )
    atomic_write(path, lambda tmp: program.save(tmp))


def load_exported(path: str, fmt: str) -> Callable[[Tensor], Tensor]:
    """A function running the exported file: ONNX Runtime's CPU provider for "onnx", the loaded program for "pt2"."""
    if fmt == "onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])
    program = torch.export.load(path).module()
    return lambda x: program(x)


def save_program(program, path: str) -> None:
    atomic_write(path, lambda tmp: torch.export.save(program, tmp))


def compare_with_eager(model: nn.Module, run: Callable[[Tensor], Tensor], sizes: Sequence[Tuple[int, int]],
                       batch: int = 1) -> List[Dict[str, float]]:
    """Per size: the largest |exported - eager| of the outputs on one random batch, and the largest |eager| output
    (the scale the difference is read against)."""
    model.eval()
    rows = []
    for i, size in enumerate(sizes):
        check_size(model, size, "check size")
        x = torch.randn(batch, getattr(model, "in_chans", 3), *size, generator=torch.Generator().manual_seed(i + 1))
        with torch.no_grad():
            ref = model(x)
            out = run(x)
        rows.append({"size": f"{size[0]}x{size[1]}", "max_abs_diff": float((out - ref).abs().max()),
                     "max_abs_output": float(ref.abs().max())})
    return rows


def time_runner(run: Callable[[Tensor], Tensor], x: Tensor, iters: int = 5, warmup: int = 1) -> float:
    """Images per second of ``run`` on ``x`` (the minimum time of ``iters`` calls after ``warmup``)."""
    with torch.no_grad():
        for _ in range(warmup):
            run(x)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - start)
    return x.shape[0] / min(times)
