"""A short demonstration: linear attention against softmax attention as the token count grows.

Prints, for growing image sizes (patch 16, so N = (side/16)^2 tokens), the time of one forward of linear
attention (elu+1 with 2D axial RoPE) and of softmax attention (SDPA) at ViT-S head shapes, and checks the
linear-attention output against the explicit O(N^2) formula on the smallest size.
"""
from __future__ import annotations

import argparse
import time

import torch

from linvision.ops import axial_rope, get_feature_map, linear_attention, softmax_attention
from linvision.ops.rope import apply_rope


def explicit_quadratic(q, k, v, rope, eps=1e-4):
    """o_i = sum_j (R_i phi(q_i)).(R_j phi(k_j)) v_j / sum_j phi(q_i).phi(k_j), float64, with the N x N matrix."""
    phi = get_feature_map("elu")
    pq, pk = phi(q.double()), phi(k.double())
    num = apply_rope(pq, rope) @ apply_rope(pk, rope).transpose(-1, -2)
    den = pq @ pk.transpose(-1, -2)
    n = k.shape[2]
    return (num / n) @ v.double() / (den.sum(-1, keepdim=True) / n + eps)


def timed(fn, repeats=3):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", type=int, nargs="+", default=[224, 512, 1024, 1536])
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {device}, threads: {torch.get_num_threads()}, heads {args.heads}, head dim {args.head_dim}")
    print(f"{'image':>10} {'tokens':>8} {'linear ms':>10} {'softmax ms':>11} {'ratio':>7}")
    for i, side in enumerate(args.sides):
        grid = (side // 16, side // 16)
        n = grid[0] * grid[1]
        q, k, v = (torch.randn(1, args.heads, n, args.head_dim, device=device) for _ in range(3))
        rope = axial_rope(args.head_dim, grid, device=device)
        if i == 0:
            err = (linear_attention(q, k, v, "elu", rope=rope).double() - explicit_quadratic(q, k, v, rope)).abs().max()
            print(f"check against the explicit O(N^2) formula at N={n}: max abs error {err:.2e}")
        with torch.no_grad():
            t_lin = timed(lambda: linear_attention(q, k, v, "elu", rope=rope))
            t_soft = timed(lambda: softmax_attention(q, k, v))
        print(f"{side:>5}x{side:<4} {n:>8} {t_lin * 1e3:>10.2f} {t_soft * 1e3:>11.2f} {t_soft / t_lin:>6.1f}x")


if __name__ == "__main__":
    main()
