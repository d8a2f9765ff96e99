"""Print the params / GFLOPs Markdown table of every registered linvision model, and what pretrained=True loads.

    .venv/bin/python tools/model_table.py            # at 224 x 224
    .venv/bin/python tools/model_table.py --size 512
    .venv/bin/python tools/model_table.py --filter "mlla*" "ravlt*"

GFLOPs are multiply-accumulates of one forward pass of one image (see linvision.engine.flops); the column without
attention leaves out the products of two activations (batched matmuls, SDPA), as papers that count convolutions
and projections only do.
"""
import argparse

import timm
import torch

import linvision
from linvision.engine.flops import count_gflops, count_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=224, help="square input side (default 224)")
    parser.add_argument("--filter", nargs="+", default=["lin*", "mlla*", "ravlt*"],
                        help="timm name patterns (default: every linvision family)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"| model | token mixers | params (M) | GFLOPs @ {args.size} | without attention | pretrained=True loads |")
    print("|---|---|---:|---:|---:|---|")
    for name in timm.list_models(args.filter):
        kwargs = dict(dynamic_img_size=True) if name.startswith("linvit") else {}
        model = timm.create_model(name, **kwargs)
        print(f"| {name} | {_mixers(model)} | {count_params(model) / 1e6:.1f} | {count_gflops(model, args.size):.2f} | "
              f"{count_gflops(model, args.size, attention=False):.2f} | {_weights(name)} |")


def _mixers(model) -> str:
    mixers = list(getattr(model, "token_mixers", None) or [model.token_mixer])
    text = f"{mixers[0]} x{len(mixers)}" if len(mixers) > 1 and len(set(mixers)) == 1 else ",".join(mixers)
    return text + (f" ({model.rope} RoPE)" if getattr(model, "rope", None) else "")


def _weights(name: str) -> str:
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is not None and cfg.has_weights:
        return f"`.{cfg.tag}`: {cfg.description}"
    tagged = [timm.models.get_pretrained_cfg(t) for t in timm.list_pretrained(f"{name}.*")]
    return "an error (no trained weights)" + "".join(f"; `.{c.tag}` loads {c.description}" for c in tagged)


if __name__ == "__main__":
    main()
