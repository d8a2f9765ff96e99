"""Print the params / GFLOPs Markdown table of every registered linvision model.

    .venv/bin/python tools/model_table.py            # at 224 x 224
    .venv/bin/python tools/model_table.py --size 512

GFLOPs are multiply-accumulates of one forward pass of one image (see linvision.engine.flops).
"""
import argparse

import timm
import torch

import linvision
from linvision.engine.flops import count_gflops, count_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=224, help="square input side (default 224)")
    parser.add_argument("--filter", default="lin*", help="timm name pattern (default lin*)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"| model | token mixers | params (M) | GFLOPs @ {args.size} |")
    print("|---|---|---:|---:|")
    for name in timm.list_models(args.filter):
        kwargs = {} if name.startswith("linhier") else dict(dynamic_img_size=True)
        model = timm.create_model(name, **kwargs)
        mixers = ",".join(getattr(model, "token_mixers", None) or [model.token_mixer])
        if getattr(model, "rope", None):
            mixers += f" ({model.rope} RoPE)"
        print(f"| {name} | {mixers} | {count_params(model) / 1e6:.1f} | {count_gflops(model, args.size):.2f} |")


if __name__ == "__main__":
    main()
