r"""Everything a GPU can tell about linvision in one run of a fixed budget, and one report.

Five parts, in the order of their value, each in a process of its own stopped at its deadline (its share of
the budget that is left when it starts):

  models       linvision's models against timm's on the same card, each in three run modes (eager under bf16
               autocast, compiled with CUDA graphs, bf16 weights; --model-modes), batch 8 then 1, 1024, 512 and
               2048 px: images/s, peak memory and compile seconds, inference and a training step, where each runs
               out of memory; first linhier_tiny_224, Swin-T and ConvNeXt-T at batch 8, 1024 px (--deciding)
  kernels      the fused kernels, the PyTorch reference and softmax attention (SDPA), forward, backward and
               forward+backward at 2k-131k tokens (B=1, H=16, D=64, bf16), with the share of the HBM bandwidth
  profile      where a small call's time goes, read with torch.profiler: wall, host and device ms, launches and
               aten ops per call, the busiest operators; the kernels and SDPA at the smallest N, a forward at
               batch 1 (512 px) of linhier_tiny_224 and vit_small_patch16_224
  recurrences  the first call (compilation included) of linear_rope, bidir_delta, bidir_gated (a gate per head),
               bidir_gated_ch (per key channel), vig_tiny and linhier_delta_tiny_224 (1024 px), then the three
               recurrences against linear_rope at 4k-262k tokens, forward and backward, on fla's kernels
  tests        the CUDA tests: pytest -m cuda, the kernels' test files first, the fused kernels not autotuned
               (LINVISION_KERNEL_AUTOTUNE=0)

On a GPU each timing part first runs about 1 s of matmuls, for the clocks to ramp up; a row that fails (a first
call, a path at one N) is recorded as that row's status and the part goes on.

report.md and report.json go into --output and are rewritten whenever a part's rows change, so a run cut at any
point keeps what it measured; each part's output goes to <part>.log beside them.

Without CUDA, or with --dry-run, every part runs at tiny sizes on the CPU (the kernels in Triton's interpreter,
the recurrences on the PyTorch path, the models at 32 px in eager mode only, the CUDA test
-k autocast_runs_in_the_autocast_dtype) and writes the same report; its figures check that the parts run and are
not speed figures. The size and mode flags are not used then.

    linvision-gpu-report                                       # on a GPU: output/gpu_report/report.md in 540 s
    linvision-gpu-report --dry-run --output /tmp/gpu_report    # every part at tiny sizes, on the CPU
    linvision-gpu-report --parts models --model-modes eager --img-size 512 1024 2048   # eager only
    linvision-gpu-report --parts kernels recurrences --budget 300 --rec-n 16384 65536
    linvision-gpu-report --parts tests --tests-k "delta or gated" --budget 900

Exit status 0 when every part passed, 1 when one failed or ran out of time (the report is written either way),
2 for bad arguments.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from linvision.benchmark import gpu_report as report
from linvision.benchmark.gpu_parts import MODEL_MODES
from linvision.utils.cli import AMP_HELP, amp_flag_options, run_cli, tool_parser


def _img_size(value: str):
    from linvision.benchmark.throughput import parse_img_size

    try:
        return parse_img_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The parser of linvision-gpu-report."""
    p = tool_parser("linvision-gpu-report", __doc__)
    p.add_argument("--output", default=os.path.join("output", "gpu_report"),
                   help="folder of report.md, report.json and the parts' logs")
    p.add_argument("--dry-run", action="store_true",
                   help="every part at tiny sizes on the CPU (what runs without CUDA anyway)")
    p.add_argument("--parts", nargs="+", choices=report.PARTS, default=list(report.PARTS), metavar="PART",
                   help=f"the parts to run, in this order: {', '.join(report.PARTS)}")
    p.add_argument("--budget", type=float, default=report.DEFAULT_BUDGET,
                   help="seconds for all parts together, shared out as each part starts")
    p.add_argument("--tests-k", default=None, metavar="EXPR",
                   help="pytest -k expression within -m cuda (default: none; 'autocast' in the dry run)")
    p.add_argument("--n", type=int, nargs="+", default=[1 << e for e in range(11, 18)],
                   help="token counts of the kernel timings")
    p.add_argument("--rec-n", type=int, nargs="+", default=[1 << e for e in range(12, 19, 2)],
                   help="token counts of the recurrence timings")
    p.add_argument("--heads", type=int, default=16, help="attention heads of the kernel and recurrence timings")
    p.add_argument("--dim", type=int, default=64, help="head dim D = Dv of the kernel and recurrence timings")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the kernel and recurrence timings' queries, keys and values")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="HBM bandwidth in TB/s, for the kernels' share of it (default: by the GPU's name)")
    p.add_argument("--sdpa-max-n", type=int, default=131072, help="the largest N SDPA is timed at")
    p.add_argument("--models", nargs="+", default=report.MODELS,
                   help="models of the comparison, each a timm name optionally with name:key=value options")
    p.add_argument("--twin", default=report.SOFTMAX_TWIN,
                   help="one of --models: the others' time and memory over its ('none': no comparison)")
    p.add_argument("--img-size", type=_img_size, nargs="+", default=[1024, 512, 2048],
                   help="input sizes of the comparison, in the order measured: a side in pixels or HxW")
    p.add_argument("--deciding", nargs="+", default=report.DECIDING, metavar="MODEL",
                   help="models of --models measured first, in every mode, at the first batch and size (the "
                        "headline comparison)")
    p.add_argument("--batch-sizes", "-b", type=int, nargs="+", default=[8, 1], dest="batches",
                   help="images per forward and per training step, in the order measured")
    p.add_argument("--first-models", nargs="+", default=report.FIRST_MODELS,
                   help="models whose first forward+backward (batch 1, 1024 px) the recurrences part times")
    p.add_argument("--profile-models", nargs="+", default=report.PROFILE_MODELS,
                   help="models whose forward at batch 1 (512 px) the profile part reads")
    p.add_argument("--model-modes", nargs="+", default=report.MODEL_RUN_MODES, choices=list(MODEL_MODES),
                   metavar="MODE",
                   help="run modes of the models part, each model in each: eager (under --amp), inductor and "
                        "reduce-overhead (torch.compile, Inductor; with CUDA graphs), bf16-weights (inference "
                        f"without autocast); of {', '.join(MODEL_MODES)}")
    p.add_argument("--amp", default="bf16", help=AMP_HELP, **amp_flag_options())
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations before the timed ones")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per figure")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options = vars(build_parser().parse_args(argv))
    options["twin"] = None if options["twin"].lower() == "none" else options["twin"]
    report.check_options(options)
    options["repo"] = report.repo_root() if "tests" in options["parts"] else None
    return report.run_report(options, argv)


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
