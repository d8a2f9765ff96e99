r"""Export a model to ONNX (or a torch.export program) with dynamic batch, height and width, and check the file
against eager PyTorch in one line; optionally time ONNX Runtime (CPU) next to eager.

    linvision-export --model mlla_tiny --pretrained --output mlla_tiny.onnx
    linvision-export --model ravlt_small --pretrained-path RAVLT_S.pth --output ravlt_s.onnx \
        --check-sizes 224 320 512 --bench-sizes 512 1024 --bench-out bench.json
    linvision-export --checkpoint output/digits_demo --output digits.pt2      # a trained run, as a program

Height and width may be any multiple of the model's stride (32 for the hierarchical families, 16 for linvit) up
to 8192; a model with a fixed input size (linvit with an absolute position embedding) exports with a dynamic
batch only. The graph holds the PyTorch path of every op (the fused Triton kernels are not exported). Exit status
1 when the check fails, 2 for bad input.
"""
import argparse
import json
import os

import torch

from linvision.benchmark.throughput import parse_img_size, size_label
from linvision.utils.cli import add_threads_arg, arg_type, run_cli, tool_parser
from linvision.utils.config import parse_kwargs
from linvision.export.program import (FORMATS, compare_with_eager, export_onnx, export_program, fixed_grid,
                                     input_constraints, load_exported, save_program, time_runner)
from linvision.utils.files import atomic_write_text
from linvision.utils.threads import set_threads


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-export."""
    p = tool_parser("linvision-export", __doc__)
    src = p.add_argument_group("model")
    src.add_argument("--model", default=None, help="a timm name of a registered model")
    src.add_argument("--model-kwargs", nargs="*", default=None, help="key=value pairs or a JSON object for the model")
    src.add_argument("--num-classes", type=int, default=None, help="classes of the head (default: the model's)")
    src.add_argument("--pretrained", action="store_true", help="the model's published weights (timm pretrained=True)")
    src.add_argument("--pretrained-path", default=None, help="local weights (safetensors, .pth or a checkpoint folder)")
    src.add_argument("--checkpoint", default=None, help="a linvision checkpoint or run folder instead of --model")
    out = p.add_argument_group("export")
    out.add_argument("--output", required=True, help="the file to write (.onnx or .pt2)")
    out.add_argument("--format", choices=FORMATS, default=None,
                     help="file format (default: from the suffix of --output)")
    out.add_argument("--img-size", type=int, nargs="+", default=None,
                     help="example size H [W] traced (default: the model's input size; a checkpoint's: the "
                          "size it was trained at; dynamic: at least twice the stride)")
    out.add_argument("--static", action="store_true", help="fix batch, height and width to the example's")
    chk = p.add_argument_group("check and benchmark")
    chk.add_argument("--check-sizes", type=arg_type(parse_img_size), nargs="*", default=None,
                     help="sizes to compare with eager, a side (square) or HxW as linvision-benchmark takes them, "
                          "e.g. 320x512 (default: the example size and two larger multiples)")
    chk.add_argument("--tolerance", type=float, default=1e-4,
                     help="largest |exported - eager| allowed, relative to max(1, largest |output|)")
    chk.add_argument("--bench-sizes", type=arg_type(parse_img_size), nargs="*", default=[],
                     help="sizes to time eager and the file at, a side or HxW")
    chk.add_argument("--bench-iters", type=int, default=3, help="timed calls per size (the minimum is kept)")
    add_threads_arg(chk)
    chk.add_argument("--bench-out", default=None, help="write the timings as JSON here")
    return p


def _load_model(args):
    """(model, the size it was trained at: a checkpoint's recorded img_size, else None)."""
    if args.checkpoint:
        from linvision.utils.checkpoint import load_model

        model, meta = load_model(args.checkpoint)
        size = meta.get("img_size")
        return model, ((size, size) if isinstance(size, int) else tuple(size) if size else None)
    if not args.model:
        raise ValueError("model: give --model NAME or --checkpoint FOLDER")
    import timm

    import linvision  # noqa: F401  registers the models
    from linvision.utils.factory import check_model_name

    check_model_name(args.model)
    kwargs = parse_kwargs(args.model_kwargs)
    if args.num_classes is not None:
        kwargs["num_classes"] = args.num_classes
    model = timm.create_model(args.model, pretrained=args.pretrained, **kwargs)
    if args.pretrained_path:
        from linvision.utils.checkpoint import load_pretrained

        load_pretrained(model, args.pretrained_path)
    return model.eval(), None


def _hw(size):
    """(height, width) of a size parse_img_size gave: a side or (H, W)."""
    return (size, size) if isinstance(size, int) else tuple(size)


def main() -> int:
    args = build_parser().parse_args()
    fmt = args.format or os.path.splitext(args.output)[1].lstrip(".")
    if fmt not in FORMATS:
        raise ValueError(f"format: {fmt!r} from the output {args.output!r}; allowed: {', '.join(FORMATS)} "
                         "(give --format or an output ending .onnx or .pt2)")
    if args.tolerance <= 0 or args.bench_iters < 1:
        raise ValueError(f"tolerance/bench_iters: need > 0 and >= 1, got {args.tolerance}, {args.bench_iters}")
    if fmt == "onnx":
        try:
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as e:
            raise ValueError(f"format: onnx needs the onnx extra (pip install 'linvision[onnx]'): {e}") from None
    threads = set_threads(args.threads)
    model, trained = _load_model(args)
    stride, fixed = input_constraints(model)
    if args.img_size:
        size = (args.img_size[0], args.img_size[-1])
    else:  # a run's checkpoint: the size it was trained at, not its model's pretrained cfg's
        size = fixed or trained or tuple(model.pretrained_cfg.get("input_size", (3, 224, 224))[1:])
        if not fixed and not args.static:  # torch.export takes a side of one stride for a constant
            size = tuple(max(side, 2 * stride) for side in size)
    dynamic = not args.static
    one_size = fixed or fixed_grid(model)
    check_sizes = None if args.check_sizes is None else [_hw(s) for s in args.check_sizes]
    if fixed_grid(model) and check_sizes and any(s != tuple(size) for s in check_sizes):
        raise ValueError(f"check_sizes: {args.model or args.checkpoint} exports at one size, {size[0]}x{size[1]} "
                         f"(its window attention fixes the grid of the graph; --img-size picks it)")
    if fmt == "onnx":
        export_onnx(model, size, args.output, dynamic=dynamic)
    else:
        save_program(export_program(model, size, dynamic=dynamic), args.output)
    shape = ("static" if not dynamic else "dynamic batch" if one_size
             else f"dynamic batch, height and width (multiples of {stride})")
    print(f"exported {args.model or args.checkpoint} ({fmt}, {shape}, example {size[0]}x{size[1]}) to {args.output}",
          flush=True)

    run = load_exported(args.output, fmt)
    if check_sizes is not None:
        sizes = check_sizes
    elif not dynamic or one_size:
        sizes = [size]
    else:
        sizes = [size, (size[0] + 3 * stride, size[1] + 3 * stride), (2 * size[0], size[1])]
    rows = compare_with_eager(model, run, sizes, batch=2) if sizes else []  # the example batch
    worst = max(rows, key=lambda r: r["max_abs_diff"] / max(1.0, r["max_abs_output"]), default=None)
    ok = True
    if worst is not None:
        largest = max(r["max_abs_output"] for r in rows)
        ok = all(r["max_abs_diff"] <= args.tolerance * max(1.0, r["max_abs_output"]) for r in rows)
        print(f"check {args.output} against eager at {', '.join(r['size'] for r in rows)}: max |diff| "
              f"{worst['max_abs_diff']:.2e} (outputs up to {largest:.3g}; tolerance {args.tolerance:g} x max(1, "
              f"that)): {'ok' if ok else 'FAILED'}", flush=True)

    if args.bench_sizes:
        print(threads, flush=True)
        bench = []
        for h, w in map(_hw, args.bench_sizes):
            x = torch.randn(1, getattr(model, "in_chans", 3), h, w)
            eager = time_runner(model, x, iters=args.bench_iters)
            exported = time_runner(run, x, iters=args.bench_iters)
            bench.append({"size": size_label((h, w)), "eager_img_s": eager, f"{fmt}_img_s": exported, "threads": torch.get_num_threads()})
            print(f"bench {h}x{w}: eager {eager:.3g} img/s, {fmt} {exported:.3g} img/s "
                  f"({exported / eager:.2f}x)", flush=True)
        if args.bench_out:
            atomic_write_text(args.bench_out, json.dumps({"model": args.model or args.checkpoint, "format": fmt,
                                                          "rows": bench}, indent=2) + "\n")
    return 0 if ok else 1


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
