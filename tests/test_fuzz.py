"""Seeded random input through the ops, every registered mixer and the smallest model of every family: each case is
either equal to a float64 reference or refused with one ValueError / TypeError line that names the argument.

Shapes (empty batches, one token, odd sizes), dtypes, strides (transposed and sliced views), token masks and
lengths, options and deliberately bad arguments are drawn from one seed per test; a failing case is reported with
its draw, so it can be replayed. ``--runslow`` runs more cases per group."""
import copy
import random
import re

import pytest
import torch
import torch.nn.functional as F

import linvision.ops as O
from linvision.layers import create_mixer, list_mixers
from linvision.ops.feature_maps import FocusedFeatureMap, PerformerFeatureMap, get_feature_map

CASES = {"ops": (160, 2000), "mixers": (50, 600), "models": (16, 160)}  # (default, --runslow)


def _count(request, group):
    fast, slow = CASES[group]
    return slow if request.config.getoption("--runslow") else fast


class Refused(Exception):
    """A case the draw expects to be refused, naming the argument the error must start with."""


def _strided(x, rng):
    """x as it is, or the same values in a non-contiguous view (a transpose of a copy, or a slice of a wider one)."""
    kind = rng.choice(["plain", "transposed", "sliced"])
    if kind == "transposed" and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "sliced":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1] + 1, dtype=x.dtype)
        wide[..., 1::2] = x
        return wide[..., 1::2]
    return x


def _run_case(fn, expect_arg, failures, draw, compare=None):
    """Run ``fn``; a refusal must be a ValueError / TypeError starting with ``expect_arg`` (None: none expected),
    anything else is a failure recorded by cause."""
    try:
        got = fn()
    except (ValueError, TypeError) as exc:
        line = str(exc)
        if expect_arg is None:
            failures.append(("refused a good case", f"{type(exc).__name__}: {line[:160]}", draw))
        elif "\n" in line or not re.search(rf"\b{re.escape(expect_arg)}\b", line.split(":")[0]):
            failures.append(("refusal not naming the argument", f"{expect_arg} -> {line[:160]}", draw))
        return
    except Exception as exc:  # noqa: BLE001 - an error from inside is what the test looks for
        failures.append(("error from inside", f"{type(exc).__name__}: {str(exc)[:160]}", draw))
        return
    if expect_arg is not None:
        failures.append(("accepted bad input", expect_arg, draw))
        return
    if compare is not None:
        problem = compare(got)
        if problem:
            failures.append(("wrong answer", problem, draw))


def _report(failures, cases, group):
    causes = {}
    for cause, detail, draw in failures:
        causes.setdefault(cause, []).append((detail, draw))
    summary = "; ".join(f"{c}: {len(v)}" for c, v in sorted(causes.items()))
    print(f"\nfuzz {group}: {cases} cases, {len(failures)} failures" + (f" ({summary})" if summary else ""))
    assert not failures, f"{len(failures)} of {cases} {group} cases failed ({summary}); first of each cause:\n" + \
        "\n".join(f"  {c}: {v[0][0]}  draw={v[0][1]}" for c, v in sorted(causes.items()))


# --- ops: float64 formulas written from the manual

def _phi(name, proj):
    return {"performer": PerformerFeatureMap(proj.shape[1], projection=proj), "focused": FocusedFeatureMap()}.get(
        name) or get_feature_map(name)


def _noncausal_ref(q, k, v, phi, valid, eps):
    """Per sample, its valid keys alone: phi(q_i) sum_j phi(k_j)^T v_j / n over (phi(q_i) . sum_j phi(k_j) / n + eps)."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        keep = valid[b] if valid is not None else torch.ones(k.shape[2], dtype=torch.bool)
        if not keep.any():
            continue
        fq, fk = phi(q[b:b + 1], True)[0], phi(k[b:b + 1, :, keep], False)[0]
        n = int(keep.sum())
        num = torch.einsum("hnd,hmd,hme->hne", fq, fk, v[b, :, keep]) / n
        den = torch.einsum("hnd,hmd->hn", fq, fk) / n + eps
        o = num / den[..., None]
        if valid is not None and q.shape[2] == k.shape[2]:
            o = o * keep[None, :, None]
        out[b] = o
    return out


def _recurrent_ref(fq, fk, v, log_gate, eps, normalize):
    """The gated recurrence token by token (log_gate (B, H, N, G))."""
    b, h, n, d = fq.shape
    s = torch.zeros(b, h, d, v.shape[-1], dtype=torch.float64)
    z, c = torch.zeros(b, h, d, dtype=torch.float64), torch.zeros(b, h, log_gate.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(n):
        gamma = log_gate[:, :, t].exp()
        s = gamma[..., None] * s + fk[:, :, t, :, None] * v[:, :, t, None, :]
        z, c = gamma * z + fk[:, :, t], gamma * c + 1
        num, den, cnt = torch.einsum("bhd,bhde->bhe", fq[:, :, t], s), (fq[:, :, t] * z).sum(-1), c.mean(-1)
        outs.append(num / (den + cnt * eps)[..., None] if normalize else num)
    return torch.stack(outs, 2)


def _draw_qkv(rng, gen, dtype):
    b, h, n, d, dv = rng.choice([0, 1, 2, 3]), rng.randint(1, 2), rng.randint(1, 19), rng.choice([2, 4, 6]), \
        rng.randint(1, 5)
    q, k, v = (torch.randn(b, h, n, x, generator=gen, dtype=torch.float64) for x in (d, d, dv))
    k = k + rng.choice([0.0, -6.0, 3.0])  # keys far from zero: what a map's stabiliser is for
    return q, k, v


_BAD = {  # argument -> how to break it
    "q": lambda a: a.update(q=a["q"][:, 0]),
    "k": lambda a: a.update(k=a["k"].to(torch.float16)),
    "v": lambda a: a.update(v=a["v"][:, :, :max(a["v"].shape[2] - 1, 0)] if a["v"].shape[2] > 1 else "v"),
    "eps": lambda a: a.update(eps=-1.0),
    "chunk_size": lambda a: a.update(chunk_size=2.5),
    "valid": lambda a: a.update(valid=torch.ones(1, 1)),
    "lengths": lambda a: a.update(lengths=torch.full((a["q"].shape[0],), a["q"].shape[2] + 1)),
    "decay": lambda a: a.update(decay="0.9"),
    "feature_map": lambda a: a.update(feature_map="softplus"),
}


def _ops_case(rng, gen):
    """One draw: (op name, call, expected refusal argument or None, float64 reference or None, tolerance)."""
    op = rng.choice(["linear", "causal", "gated", "decay", "bidir_gated", "delta", "bidir_delta"])
    dtype = rng.choice([torch.float64, torch.float64, torch.float32])
    q, k, v = _draw_qkv(rng, gen, dtype)
    bsz, heads, n, d = q.shape
    maps = ["elu", "relu", "focused"] + (["exp", "performer"] * 2 if op == "linear" else [])
    fmap = rng.choice(maps)
    proj = torch.randn(rng.randint(1, 8), d, generator=gen)
    args = dict(q=q, k=k, v=v, eps=rng.choice([1e-4, 1e-2]), chunk_size=rng.randint(1, 8), feature_map=fmap)
    if op == "linear":
        args["valid"] = torch.rand(bsz, n, generator=gen) < 0.7 if rng.random() < 0.6 else None
        padding = None if args["valid"] is None else ~args["valid"]
    if op.startswith("bidir"):
        args["lengths"] = torch.randint(1, n + 1, (bsz,), generator=gen) if rng.random() < 0.6 else None
        padding = None if args["lengths"] is None else torch.arange(n) >= args["lengths"][:, None]
    if op in ("linear",) or op.startswith("bidir"):
        if padding is not None and rng.random() < 0.5:  # the padding may hold anything, a NaN or an inf too
            fill = rng.choice([float("nan"), float("inf"), 1e30])
            args["k"] = k.masked_fill(padding[:, None, :, None], fill)
            args["v"] = v.masked_fill(padding[:, None, :, None], fill)
    if op == "decay":
        args["decay"] = rng.choice([0.5, 0.9, 1.0])
    bad = None
    if rng.random() < 0.3:
        bad = rng.choice([a for a in _BAD if (a in args or a in ("q", "k", "v")) and not (a == "lengths" and not bsz)
                          and not (a == "eps" and "delta" in op)])  # the delta rule has no eps
        _BAD[bad](args)
    return op, args, bad, proj, dtype


def _ops_call(op, a, proj, dtype):
    cast = {x: (a[x].to(dtype) if torch.is_tensor(a[x]) and a[x].is_floating_point() and a[x].dtype == torch.float64
                else a[x]) for x in ("q", "k", "v")}
    q, k, v = (_strided(t, random.Random(0)) if torch.is_tensor(t) else t for t in (cast["q"], cast["k"], cast["v"]))
    fmap = _phi(a["feature_map"], proj.to(torch.float64)) if a["feature_map"] in ("performer", "focused") \
        else a["feature_map"]
    common = dict(eps=a["eps"], chunk_size=a["chunk_size"])
    if op == "linear":
        return O.linear_attention(q, k, v, fmap, valid=a.get("valid"), eps=a["eps"], chunk_size=a["chunk_size"])
    if op == "causal":
        return O.linear_attention(q, k, v, fmap, causal=True, **common)
    gate = -torch.rand(*q.shape[:3], generator=torch.Generator().manual_seed(1), dtype=torch.float64) \
        if torch.is_tensor(q) and q.dim() == 4 else torch.zeros(1)
    if op == "gated":
        return O.gated_linear_attention(q, k, v, gate, fmap, backend="torch", **common)
    if op == "decay":
        return O.decay_linear_attention(q, k, v, a["decay"], fmap, backend="torch", **common)
    if op == "bidir_gated":
        return O.bidirectional_gated_linear_attention(q, k, v, gate, fmap, backend="torch", lengths=a["lengths"],
                                                      **common)
    beta = torch.sigmoid(gate * 3)
    if op == "delta":
        return O.delta_rule_attention(q, k, v, beta, fmap, backend="torch", chunk_size=a["chunk_size"])
    return O.bidirectional_delta_rule_attention(q, k, v, beta, fmap, backend="torch", chunk_size=a["chunk_size"],
                                                lengths=a["lengths"])


def _delta_ref(fq, fk, v, beta, strict=False):
    fq, fk = F.normalize(fq, dim=-1), F.normalize(fk, dim=-1)
    s = torch.zeros(*fq.shape[:2], fq.shape[-1], v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(fq.shape[2]):
        read = torch.einsum("bhd,bhde->bhe", fq[:, :, t], s)
        kt, bt = fk[:, :, t], beta[:, :, t, None, None]
        s = s - bt * kt[..., None] * torch.einsum("bhd,bhde->bhe", kt, s)[:, :, None] + bt * kt[..., None] * \
            v[:, :, t, None]
        outs.append(read if strict else torch.einsum("bhd,bhde->bhe", fq[:, :, t], s))
    return torch.stack(outs, 2)


def _ops_reference(op, a, proj):
    q, k, v, eps = a["q"], a["k"], a["v"], a["eps"]
    phi = _phi(a["feature_map"], proj.to(torch.float64))
    if op == "linear":
        return _noncausal_ref(q, k, v, phi, a.get("valid"), eps)
    fq, fk = phi(q, True), phi(k, False)
    gate = -torch.rand(*q.shape[:3], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if op == "causal":
        return _recurrent_ref(fq, fk, v, torch.zeros(*q.shape[:3], 1, dtype=torch.float64), eps, True)
    if op == "decay":
        import math
        return _recurrent_ref(fq, fk, v, torch.full((*q.shape[:3], 1), math.log(a["decay"]), dtype=torch.float64),
                              eps, True)
    if op == "gated":
        return _recurrent_ref(fq, fk, v, gate[..., None], eps, True)
    if op == "delta":
        return _delta_ref(fq, fk, v, torch.sigmoid(gate * 3))
    return _bidir_ref(op, q, k, v, phi, gate, eps, a["lengths"])


def _bidir_ref(op, q, k, v, phi, gate, eps, lengths):
    """Each sample's first lengths[b] tokens alone: a forward scan plus a strictly backward one, zeros after."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        n = q.shape[2] if lengths is None else int(lengths[b])
        fq, fk, vb, g = phi(q[b:b + 1, :, :n], True), phi(k[b:b + 1, :, :n], False), v[b:b + 1, :, :n], \
            gate[b:b + 1, :, :n]
        flip = lambda x: x.flip(2)  # noqa: E731
        if op == "bidir_delta":
            beta = torch.sigmoid(g * 3)
            out[b, :, :n] = (_delta_ref(fq, fk, vb, beta) + flip(_delta_ref(*map(flip, (fq, fk, vb, beta)), strict=True)))[0]
            continue
        parts = []
        for fwd in (True, False):
            x = (fq, fk, vb, g[..., None]) if fwd else tuple(map(flip, (fq, fk, vb, g[..., None])))
            parts.append(_pieces(*x, strict=not fwd, flip=not fwd))
        (num_f, den_f, c_f), (num_b, den_b, c_b) = parts
        out[b, :, :n] = ((num_f + num_b) / (den_f + den_b + (c_f + c_b) * eps)[..., None])[0]
    return out


def _pieces(fq, fk, v, log_gate, strict, flip):
    """(numerator, denominator, decayed count) of one direction, token by token, in the original order."""
    s = torch.zeros(*fq.shape[:2], fq.shape[-1], v.shape[-1] + 1, dtype=torch.float64)
    c = torch.zeros(*fq.shape[:2], 1, dtype=torch.float64)
    rows = []
    for t in range(fq.shape[2]):
        gamma = log_gate[:, :, t].exp()
        if strict:  # the token's own gate, not its own term: gamma_i ... gamma_{j-1} for j > i
            rows.append((torch.einsum("bhd,bhde->bhe", fq[:, :, t], gamma[..., None] * s), (gamma * c)[..., 0]))
        s = gamma[..., None] * s + fk[:, :, t, :, None] * F.pad(v[:, :, t], (0, 1), value=1.0)[:, :, None, :]
        c = gamma * c + 1
        if not strict:
            rows.append((torch.einsum("bhd,bhde->bhe", fq[:, :, t], s), c[..., 0].clone()))
    read = torch.stack([r for r, _ in rows], 2)
    count = torch.stack([x for _, x in rows], 2)
    if flip:
        read, count = read.flip(2), count.flip(2)
    return read[..., :-1], read[..., -1], count


def test_fuzz_ops(request):
    rng, gen = random.Random(60), torch.Generator().manual_seed(60)
    failures, cases = [], _count(request, "ops")
    for i in range(cases):
        op, args, bad, proj, dtype = _ops_case(rng, gen)
        draw = f"#{i} {op} B,H,N={tuple(args['q'].shape[:3]) if torch.is_tensor(args['q']) else '?'} " \
               f"map={args['feature_map']} {dtype} bad={bad}"
        tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-3, atol=2e-4)

        def compare(got, op=op, args=args, proj=proj, tol=tol):
            want = _ops_reference(op, args, proj)
            if got.shape != want.shape:
                return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
            try:
                torch.testing.assert_close(got.to(torch.float64), want, **tol)
            except AssertionError as exc:
                return str(exc).splitlines()[-2].strip() if len(str(exc).splitlines()) > 1 else str(exc)
            return None
        _run_case(lambda: _ops_call(op, args, proj, dtype), bad, failures, draw, compare)
    _report(failures, cases, "ops")


# --- mixers: every registered mixer, float32 against its own float64 copy, each sample against itself alone

_MIXER_BAD = [("x", lambda m, x, hw: (x.flatten(0, 1), hw)), ("x", lambda m, x, hw: (x[..., :-1], hw)),
              ("hw", lambda m, x, hw: (x, (hw[0] + 1, hw[1]))), ("hw", lambda m, x, hw: (x, (hw[0], 0)))]
_OPTION_BAD = {"gated_cnn": [("kernel_size", 4), ("expansion_ratio", 0)], "swin_window": [("window", 2.5)],
               "hybrid": [("window", 0)], "agent": [("agent_grid", (3, -1))], "cswin_stripes": [("stripe", 0)],
               "linear": [("lepe_kernel", 2)], "softmax": [("proj_drop", 2.0)]}


def _mixer_case(rng, gen, name):
    heads = rng.choice([1, 2])
    dim = heads * rng.choice([4, 8])
    h, w = rng.randint(1, 6), rng.randint(1, 6)
    x = torch.randn(rng.choice([0, 1, 2]), h * w, dim, generator=gen)
    options, bad = {}, None
    roll = rng.random()
    if roll < 0.15 and name in _OPTION_BAD:
        bad, value = rng.choice(_OPTION_BAD[name])
        options[bad] = value
    return dim, heads, x, (h, w), options, bad, roll


def test_fuzz_mixers(request):
    rng, gen = random.Random(61), torch.Generator().manual_seed(61)
    failures, cases = [], _count(request, "mixers")
    names = list_mixers()
    for i in range(cases):
        name = names[i % len(names)]
        dim, heads, x, hw, options, bad, roll = _mixer_case(rng, gen, name)
        draw = f"#{i} {name} dim={dim} heads={heads} x={tuple(x.shape)} hw={hw} options={options}"
        if bad is not None:
            _run_case(lambda: create_mixer(name, dim, heads, **options), bad, failures, draw)
            continue
        torch.manual_seed(i)
        try:
            mixer = create_mixer(name, dim, heads).eval()
        except (ValueError, TypeError) as exc:  # a (dim, heads) the mixer cannot take, said in one line
            if "\n" in str(exc):
                failures.append(("refusal not naming the argument", str(exc)[:160], draw))
            continue
        call_x, call_hw = x, hw
        if 0.15 <= roll < 0.35:
            bad, breaker = rng.choice(_MIXER_BAD)
            call_x, call_hw = breaker(mixer, x, hw)
            _run_case(lambda: mixer(call_x, call_hw), bad, failures, draw + f" bad={bad}")
            continue
        strided = _strided(x, rng)

        def compare(got, mixer=mixer, x=x, hw=hw):
            wide = copy.deepcopy(mixer).double()
            with torch.no_grad():
                want = wide(x.double(), hw)
                alone = [mixer(x[b:b + 1], hw) for b in range(x.shape[0])]
            if got.shape != x.shape:
                return f"shape {tuple(got.shape)}"
            problems = []
            if not torch.allclose(got.double(), want, rtol=1e-3, atol=1e-4):
                problems.append(f"float32 vs float64: {(got.double() - want).abs().max():.2e}")
            if alone and not torch.allclose(torch.cat(alone), got, rtol=1e-4, atol=1e-5):
                problems.append("a sample differs from itself alone")
            return "; ".join(problems) or None
        with torch.no_grad():
            _run_case(lambda: mixer(strided, hw), None, failures, draw, compare)
    _report(failures, cases, "mixers")


# --- models: the smallest of every family

def test_fuzz_models(request):
    from support import ONE_PER_FAMILY, small_model
    rng, gen = random.Random(62), torch.Generator().manual_seed(62)
    failures, cases = [], _count(request, "models")
    built, wides = {}, {}
    for i in range(cases):
        name = ONE_PER_FAMILY[i % len(ONE_PER_FAMILY)]
        if name not in built:
            built[name] = small_model(name)
            wides[name] = copy.deepcopy(built[name]).double()
        model, wide = built[name], wides[name]
        fixed = name.startswith("inline_deit")
        multiple = 16 if name.startswith("linvit") else 1
        size = (64, 64) if fixed else (rng.randint(1, 48) // multiple * multiple or multiple,
                                       rng.randint(1, 48) // multiple * multiple or multiple)
        x = torch.randn(rng.choice([0, 1, 2]), 3, *size, generator=gen)
        draw = f"#{i} {name} x={tuple(x.shape)}"
        roll = rng.random()
        if roll < 0.3:
            bad = rng.choice([x.flatten(0, 1), x[:, :2], x.to(torch.int64), x[..., :0]])
            _run_case(lambda: model(bad), "x", failures, draw + f" bad={tuple(bad.shape)} {bad.dtype}")
            continue

        def compare(got, wide=wide, x=x):
            with torch.no_grad():
                want = wide(x.double())
            if got.shape != (x.shape[0], 5):
                return f"shape {tuple(got.shape)}"
            if not torch.allclose(got.double(), want, rtol=1e-3, atol=1e-4):
                return f"float32 vs float64: {(got.double() - want).abs().max():.2e}"
            return None
        with torch.no_grad():
            _run_case(lambda: model(_strided(x, rng)), None, failures, draw, compare)
    _report(failures, cases, "models")
