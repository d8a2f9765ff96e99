"""What several test files share: tiny data on disk, the tools run in-process, reading a run's metrics, and the
authors' checkpoint layouts of the published models with the comparisons made on them, the float64 formulas the
ops are checked against, the registered models at CPU size, and small diffusers peers with random weights."""
import collections
import contextlib
import glob
import importlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
import time
import tomllib

import numpy as np
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
TINY_VIT = ["img_size=16", "patch_size=4", "dynamic_img_size=true"]
# Every subprocess a test starts gets a deadline: a hang on a busy machine fails one test, not the whole run.
SUBPROCESS_TIMEOUT = 600


def spawn(args, log_dir, name, **kwargs):
    """Start ``args`` with stdout and stderr going to files in ``log_dir`` (``name``.out / ``name``.err), so the
    child never blocks on a full pipe while the test polls; read them back with :func:`logs`."""
    out = open(os.path.join(log_dir, f"{name}.out"), "w")
    err = open(os.path.join(log_dir, f"{name}.err"), "w")
    try:
        return subprocess.Popen(args, stdout=out, stderr=err, text=True, **kwargs)
    finally:
        out.close()
        err.close()


def logs(log_dir, name):
    """(stdout, stderr) that :func:`spawn` wrote for ``name``."""
    return tuple(open(os.path.join(log_dir, f"{name}.{ext}")).read() for ext in ("out", "err"))


def wait_until(condition, proc, timeout=SUBPROCESS_TIMEOUT, what="the condition", interval=0.2):
    """Poll until ``condition()`` holds or ``proc`` has exited; kill ``proc`` and fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not condition():
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=60)
            raise AssertionError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(interval)


def run_subprocess(args, timeout=SUBPROCESS_TIMEOUT, **kwargs):
    """``subprocess.run`` with output captured as text and a deadline."""
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)


def write_image_folder(root, classes=3, train_per_class=4, val_per_class=2, size=16, seed=0):
    """Images of class c are noise around grey level 60 * c + 40, so a small model can tell them apart."""
    rng = np.random.RandomState(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = os.path.join(root, split, f"class{c}")
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                pixels = np.clip(60 * c + 40 + rng.randn(size, size, 3) * 10, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))
    return str(root)


def step_losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "step"]


def _scripts():
    """Console-script name -> entry point ("module:function"), from pyproject.toml."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


SCRIPTS = _scripts()


def command_parser(command):
    """The argument parser that console script ``command`` runs: its module's ``build_parser()``, or in a module of
    several commands (linvision.tools.diffusion, linvision.tools.kernels) the one its ``PARSERS`` names."""
    module = importlib.import_module(SCRIPTS[command].split(":")[0])
    parsers = getattr(module, "PARSERS", None)
    return parsers[command]() if parsers is not None else module.build_parser()


def command_argv(command):
    """The start of a process that runs console script ``command`` of this checkout, as the installed script does:
    its entry point, called and its result the exit status (``python -c``; an installed script may predate a
    change of pyproject.toml)."""
    module, function = SCRIPTS[command].split(":")
    return [PY, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


def run_tool(tool, *args, check=True):
    """Run a tool in this process (no second torch import) with the command line ``args``: a console script by its
    name (``linvision-train-diffusion``: its entry point, as the installed script calls it) or a file of
    linvision/tools/ (``train.py``: as ``python linvision/tools/train.py args`` runs it)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = [tool, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if tool in SCRIPTS:
                module, function = SCRIPTS[tool].split(":")
                code = getattr(importlib.import_module(module), function)() or 0
            else:
                runpy.run_path(os.path.join(ROOT, "linvision", "tools", tool), run_name="__main__")
                code = 0
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.argv = argv
    proc = subprocess.CompletedProcess([tool, *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{tool} failed ({code}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def tiny_ablate_flags(data, out, *extra):
    """linvision-ablate's flags for a tiny linhier on ``data`` (one epoch at 32 px, one timed run), into out/ab."""
    return ["--dataset", "folder", "--data-dir", data, "--img-size", "32", "--model", "linhier_tiny_224",
            "--model-kwargs", '{"depths": [1, 1, 1, 1], "dims": [8, 16, 16, 16], "num_heads": [1, 1, 1, 1]}',
            "--epochs", "1", "--batch-size", "4", "--eval-sizes", "32", "--bench-sizes", "32",
            "--bench-batch-size", "1", "--bench-iters", "1", "--device", "cpu", "--output", str(out),
            "--experiment", "ab", "--no-progress", *extra]


def write_ablation_json(folder, seeds=(0,), mixer="linear", **changes):
    """``folder``/ablation.json as linvision-ablate writes it, with made-up scores (50 + seed at 32 px; nothing is
    trained), for what reads ablations; ``changes`` replace its top-level keys. Returns the folder as a string."""
    runs = [{"seed": s, "train_s": 1.0, "best_top1": 50.0 + s, "num_classes": 3, "accuracy": {"32": 50.0 + s}}
            for s in seeds]
    result = {"task": "classify", "model": "linhier_tiny_224", "model_kwargs": {}, "img_size": 32, "epochs": 1,
              "seed": seeds[0], "seeds": list(seeds), "dataset": "folder", "eval_sizes": [32], "bench_sizes": [32],
              "bench_batch_size": 1, "device": "cpu",
              "rows": [{"mixer": mixer, "params_m": 1.0, "gflops": 0.5, "runs": runs}], **changes}
    os.makedirs(folder)
    with open(os.path.join(folder, "ablation.json"), "w") as f:
        json.dump(result, f)
    return str(folder)


def tiny_train_flags(data, out, *extra):
    return ["--dataset", "folder", "--data-dir", data, "--img-size", "16", "--model", "test_vit",
            "--model-kwargs", *TINY_VIT, "--batch-size", "4", "--output", out, "--no-progress", "--device", "cpu",
            *extra]


def fenced_blocks(text: str):
    """(first line number, language, lines) of every fenced code block of a Markdown page."""
    blocks, lang, body, first = [], None, [], 0
    for number, line in enumerate(text.split("\n"), 1):
        if lang is None and line.startswith("```"):
            lang, body, first = line[3:].strip(), [], number + 1
        elif lang is not None and line.strip() == "```":
            blocks.append((first, lang, body))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


# README and every page of the manual
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                          recursive=True))


def python_examples():
    """(page, first line, code) of every Python block of README.md and the manual."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        found += [(page, text[:m.start()].count("\n") + 2, m.group(1))
                  for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]
    return found


def joined_lines(body, first: int):
    """(line number, text) of a shell block's lines (the first is line ``first``), continuation lines joined."""
    out, pending, start = [], "", 0
    for i, raw in enumerate(body):
        line = raw.rstrip()
        if not pending:
            start = first + i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        out.append((start, line))
    return out


PUBLISHED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "published")


def published_tensors(name):
    """(name, shape, dtype) of every tensor of an authors' checkpoint layout, from tests/data/published/NAME.txt."""
    with open(os.path.join(PUBLISHED_DATA, f"{name}.txt")) as f:
        for line in f.read().splitlines():
            if line.startswith("#"):
                continue
            key, shape, dtype = line.split()
            yield key, () if shape == "-" else tuple(int(n) for n in shape.split(",")), dtype


class TrainingConfig:
    """Stands for the yacs config / namespace objects the authors pickle beside the weights."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class Crafted:
    """An object whose unpickling would create ``marker`` if the reader ran code from the file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def serve_downloads_from(monkeypatch, tmp_path, path):
    """timm's url download with only the network transfer replaced by a copy of ``path`` (timm's cache under
    ``tmp_path``/torch_home); returns the list of urls asked for, filled as they are."""
    import shutil

    import timm.models._hub as hub

    asked = []

    def fetch(url, dst, hash_prefix=None, progress=True):
        asked.append(url)
        shutil.copy(path, dst)

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(hub, "download_url_to_file", fetch)
    return asked


def serve_hub_downloads_from(monkeypatch, path):
    """timm's Hugging Face hub download with only the transfer replaced: every file asked for is ``path``; returns
    the list of (repo id, file name) asked for, filled as they are."""
    import timm.models._hub as hub

    asked = []

    def download(repo_id, filename, revision=None, cache_dir=None):
        asked.append((repo_id, filename))
        return str(path)

    monkeypatch.setattr(hub, "hf_hub_download", download)
    return asked


# ---- the authors' checkpoint layouts (tests/data/published/*.txt) with random values, and comparing them ----

# (stage, block) of an authors' block tensor, in the four namings: layers.S.blocks.B (Swin, MLLA, RAVLT, ViG-H),
# blocks.B (isotropic), blockS.B (PVT, S from 1), stageS.B (CSWin, S from 1)
_BLOCK_KEY = re.compile(r"^(?:layers\.(\d+)\.blocks|blocks|block(\d+)|stage(\d+))\.(\d+)\.")


def _block_of(key):
    match = _BLOCK_KEY.match(key)
    if match is None:
        return None
    layer, pvt, cswin, block = match.groups()
    if layer is not None:
        return int(layer), int(block)
    return (int(pvt or cswin) - 1 if pvt or cswin else 0), int(block)


def authors_layout(name, seed=0, blocks=None, ones=None):
    """A state dict with the names, shapes and dtypes of the authors' checkpoint of ``name``, random values: floats
    N(0, 0.2^2) drawn in float64, BN running variances in [0.5, 1.5), integer buffers 100 (a count) or in
    [0, 169) (an index); ``ones``: a regular expression of the keys that get 1 added (norm weights about 1).
    ``blocks``: keep only the first blocks of each stage, that many (an int) or per stage (a tuple): a reduced
    model's file."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape, dtype in published_tensors(name):
        where = _block_of(key)
        if blocks is not None and where is not None:
            if where[1] >= (blocks if isinstance(blocks, int) else blocks[where[0]]):
                continue
        if dtype == "int64":
            out[key] = torch.tensor(100) if shape == () else torch.randint(0, 169, shape, generator=g)
        elif key.endswith("running_var"):
            out[key] = torch.rand(shape, generator=g, dtype=torch.float64).float() + 0.5
        else:
            value = torch.randn(shape, generator=g, dtype=torch.float64) * 0.2
            out[key] = (value + 1 if ones is not None and re.search(ones, key) else value).float()
    return out


def save_training_file(path, state, **extra):
    """A file laid out as the authors' training scripts save it: the weights under 'model', optimizer and scheduler
    state, the epoch, the pickled config and arguments, plus ``extra`` entries (an EMA copy, a crafted payload)."""
    import argparse

    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}, "lr_scheduler": {},
                "epoch": 299, "config": TrainingConfig(lr=1e-3), "args": argparse.Namespace(epochs=300),
                **extra}, path)


RESOLUTION_BUFFERS = (".attn.rope.rotations", ".RoPE.angle")  # MLLA's and RAVLT's: rebuilt per input, never loaded


def save_published(path, state, **extra):
    """A file laid out as MLLA's and RAVLT's training scripts write it (weights under 'model', an EMA copy beside
    them, a pickled config, optimizer state), plus ``extra`` entries."""
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    save_training_file(path, state, state_dict_ema=ema, model_ema=ema, **extra)


def sorted_values(tensors):
    """The values of all ``tensors``, sorted, in float64: two state dicts with equal sorted values hold the same
    numbers (nothing missing, duplicated or changed), whatever their names and shapes."""
    return torch.sort(torch.cat([t.double().flatten() for t in tensors])).values


def assert_same_values(model_state, file_state):
    """Every value of ``file_state`` is in ``model_state`` and nothing else (a bijection of the values)."""
    torch.testing.assert_close(sorted_values(model_state.values()), sorted_values(file_state.values()), rtol=0, atol=0)


def layer_norm(x, weight, bias, eps):
    """LayerNorm over the last axis, written out (biased variance)."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def write_rope_checkpoint(folder, mixer_kwargs=None, seed=0):
    """A checkpoint folder of a small random linvit with 2D RoPE and a learned absolute embedding (linear_rope,
    patch 8, trained size 96 px: a 12 x 12 grid) for the digits, as linvision-train writes one; returns the
    folder."""
    import timm
    import torch

    from linvision.utils.checkpoint import save_checkpoint

    kwargs = dict(patch_size=8, dynamic_img_size=True, token_mixer="linear_rope", embed_dim=32, depth=1,
                  num_heads=2, mixer_kwargs=dict(mixer_kwargs or {"rope_theta": 10.0}))
    torch.manual_seed(seed)
    model = timm.create_model("linvit_tiny_patch16_224", num_classes=10, img_size=96, **kwargs)
    meta = {"model": "linvit_tiny_patch16_224", "num_classes": 10, "in_chans": 3, "model_kwargs": kwargs,
            "img_size": 96, "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center",
            "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "classes": [str(i) for i in range(10)],
            "dataset": "digits"}
    save_checkpoint(str(folder), model, meta)
    return str(folder)


class AtenOps(TorchDispatchMode):
    """Counts the ops called inside it by name (``names``, a Counter; a Triton kernel's own work is none), running
    each as it is."""

    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class DeviceLaunches(TorchDispatchMode):
    """A dispatch mode counting the device work of a call as a GPU would launch it, on any machine: every aten op
    that computes is one launch (shape-only ops, allocations and views are none); a call of the fused
    linear-attention op (the ``linvision::`` ops) is one, and is not run (its outputs are zeros of its shapes,
    which counting does not need). ``names``: the counts by op; ``total``: their sum."""

    SHAPE_ONLY = {"empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view", "as_strided", "select",
                  "slice", "transpose", "t", "unsqueeze", "squeeze", "expand", "alias", "detach", "unbind", "permute",
                  "reshape", "flatten", "unflatten", "split", "chunk", "split_with_sizes", "view_as", "lift_fresh",
                  "_reshape_alias", "narrow"}

    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    @property
    def total(self):
        return sum(self.names.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "linvision":
            self.names["linvision::" + func.overloadpacket.__name__] += 1
            q, k, v = args[:3]
            b, h, nq, d = q.shape
            return (q.new_zeros(b, nq, h, v.shape[-1]).transpose(1, 2),
                    q.new_zeros(b, h, d, v.shape[-1], dtype=torch.float32), q.new_zeros(b, h, d, dtype=torch.float32))
        name = func.overloadpacket.__name__
        if name not in self.SHAPE_ONLY:
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


# --- float64 formulas the ops are checked against ------------------------------------------------------------------

REF_EPS = 1e-4  # the denominators' epsilon of the formulas below (the ops' default)


def explicit_linear_attention(q, k, v, phi, rope=None, causal=False, eps=REF_EPS):
    """o_i = sum_j w_ij v_j / (sum_j phi(q_i).phi(k_j) / n_i + eps) with the full N x N matrices, float64.

    w_ij = (R_i phi(q_i)).(R_j phi(k_j)) / n_i, n_i = number of tokens token i sees.
    """
    from linvision.ops import apply_rope, get_feature_map

    phi = get_feature_map(phi, dim=q.shape[-1])
    pq, pk = phi(q.double(), True), phi(k.double(), False)
    rq, rk = (apply_rope(pq, rope), apply_rope(pk, rope)) if rope is not None else (pq, pk)
    a_num = rq @ rk.transpose(-1, -2)  # (B, H, N, N)
    a_den = pq @ pk.transpose(-1, -2)
    n = k.shape[2]
    if causal:
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        a_num, a_den = a_num.masked_fill(~mask, 0), a_den.masked_fill(~mask, 0)
        count = torch.arange(1, n + 1, dtype=torch.float64)[:, None]
    else:
        count = torch.tensor(float(n), dtype=torch.float64)
    return (a_num / count) @ v.double() / (a_den.sum(-1, keepdim=True) / count + eps)


def elu_phi(x):
    """The default feature map, elu(x) + 1, written out."""
    return torch.nn.functional.elu(x) + 1


def naive_gated(q, k, v, log_gate, normalize=True, eps=REF_EPS):
    """Per-token loop of S_t = diag(g_t) S_{t-1} + phi(k_t)^T v_t, z and count likewise. log_gate (B, H, N, G)."""
    b, h, n, d = q.shape
    s = q.new_zeros(b, h, d, v.shape[-1])
    z = q.new_zeros(b, h, d)
    cnt = q.new_zeros(b, h, log_gate.shape[-1])
    out = []
    for t in range(n):
        g = log_gate[:, :, t].exp()
        pk = elu_phi(k[:, :, t])
        s = g.unsqueeze(-1) * s + pk.unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        z = g * z + pk
        cnt = g * cnt + 1
        pq = elu_phi(q[:, :, t])
        num = torch.einsum("bhd,bhde->bhe", pq, s)
        den = (pq * z).sum(-1) + eps * cnt.mean(-1)
        out.append(num / den.unsqueeze(-1) if normalize else num)
    return torch.stack(out, 2)


def naive_delta(q, k, v, beta, s0=None, strict=False):
    """Per-token loop of the delta rule on L2-normalised q, k (identity feature map); strict reads S_{t-1}."""
    q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    b, h, n, d = q.shape
    s = q.new_zeros(b, h, d, v.shape[-1]) if s0 is None else s0
    out = []
    for t in range(n):
        kt = k[:, :, t]
        prev = s
        s = s - beta[:, :, t, None, None] * kt.unsqueeze(-1) * (torch.einsum("bhd,bhde->bhe", kt, s)
                                                                - v[:, :, t]).unsqueeze(-2)
        out.append(torch.einsum("bhd,bhde->bhe", q[:, :, t], prev if strict else s))
    return torch.stack(out, 2), s


# --- the registered models, and each reduced to CPU size -----------------------------------------------------------

FAMILY_NAMES = {
    "linvit": [
        "linvit_tiny_patch16_224", "linvit_small_patch16_224", "linvit_base_patch16_224",
        "linvit_tiny_patch16_rope_224", "linvit_small_patch16_rope_224", "linvit_base_patch16_rope_224",
        "linvit_small_patch16_rope_mixed_224", "linvit_tiny_patch16_pola_224", "linvit_small_patch16_pola_224",
        "linvit_base_patch16_pola_224",
    ],
    "linhier": [
        "linhier_tiny_224", "linhier_small_224", "linhier_base_224", "linhier_gcnn_femto_224", "linhier_gcnn_tiny_224",
        "linhier_delta_femto_224", "linhier_delta_tiny_224", "linhier_delta_small_224",
    ],
    "mlla": ["mlla_tiny", "mlla_small", "mlla_base"],
    "ravlt": ["ravlt_tiny", "ravlt_small", "ravlt_base", "ravlt_large"],
    "mavit": ["mavit_tiny", "mavit_small", "mavit_base", "mavit_large"],
    "vig": ["vig_tiny", "vig_small", "vig_base", "vig_h_tiny", "vig_h_small", "vig_h_base"],
    "inline": ["inline_deit_tiny", "inline_deit_small", "inline_deit_base", "inline_swin_tiny", "inline_swin_small",
               "inline_swin_base", "inline_pvt_tiny", "inline_pvt_small", "inline_pvt_medium", "inline_pvt_large",
               "inline_cswin_tiny", "inline_cswin_small", "inline_cswin_base"],
    "polaformer": ["pola_swin_tiny", "pola_swin_small", "pola_swin_base", "pola_pvt_tiny", "pola_pvt_small"],
}
ALL_NAMES = [n for names in FAMILY_NAMES.values() for n in names]
# Reduced configurations (same code paths, CPU-sized) for the checks that need backward or many passes.
SMALL_VIT = dict(embed_dim=32, depth=3, num_heads=2)
SMALL_HIER = dict(depths=(1, 1, 2, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3))


def is_isotropic(name):
    """linvit and the published isotropic families (ViG, not ViG-H; InLine-DeiT, a linvit with its own mixer):
    tokens out of forward_features, blocks under ``blocks``."""
    return name.startswith(("linvit", "vig", "inline_deit")) and not name.startswith("vig_h")


def reduced_kwargs(name, one_block=False):
    """The keyword arguments that build registered model ``name`` at CPU size (its family's code paths); with
    ``one_block``, one block per stage (the isotropic models one block in all)."""
    vit, hier = SMALL_VIT, SMALL_HIER
    if one_block:
        vit, hier = dict(vit, depth=1), dict(hier, depths=(1, 1, 1, 1))
    if name.startswith("inline_deit"):  # built for 224-448 px: reduced to 64 px as well
        return dict(vit, img_size=64)
    return dict(vit) if is_isotropic(name) else dict(hier)


# the smallest model of every family
ONE_PER_FAMILY = ["linvit_tiny_patch16_rope_224", "linhier_tiny_224", "linhier_delta_femto_224",
                  "linhier_gcnn_femto_224", "mlla_tiny", "ravlt_tiny", "mavit_tiny", "pola_swin_tiny", "inline_swin_tiny",
                  "pola_pvt_tiny", "inline_pvt_tiny", "inline_cswin_tiny", "vig_tiny", "vig_h_tiny", "inline_deit_tiny"]


def small_model(name, **kwargs):
    """Registered model ``name`` with one block per stage, 5 classes, seeded weights, in eval mode."""
    import timm

    import linvision  # noqa: F401  (registers the models)

    torch.manual_seed(0)
    return timm.create_model(name, num_classes=5, **reduced_kwargs(name, one_block=True), **kwargs).eval()


# --- diffusers peers with random weights ---------------------------------------------------------------------------

SANA_SMALL = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                  num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=12,
                  sample_size=8, patch_size=2)


def randomize(model, seed):
    """``model`` with every parameter drawn anew (non-zero everywhere, of a size that keeps the outputs O(1))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() < 2 else p.shape[-1] ** -0.5 * 0.5))
    return model


def diffusers_sana(seed=0, **overrides):
    """A small diffusers ``SanaTransformer2DModel`` (``SANA_SMALL`` with ``overrides``), random weights, eval mode."""
    import diffusers

    torch.manual_seed(seed)
    return randomize(diffusers.SanaTransformer2DModel(**{**SANA_SMALL, **overrides}).eval(), seed)


def tiny_autoencoder(kind, path=None):
    """A tiny random diffusers autoencoder of ``kind`` ("AutoencoderKL" or "AutoencoderDC"), saved to ``path`` when
    given."""
    import diffusers

    torch.manual_seed(0)
    if kind == "AutoencoderKL":
        ae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                     up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                                     layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
                                     scaling_factor=0.5, shift_factor=0.1)
    else:
        ae = diffusers.AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=4,
                                     encoder_block_types="ResBlock", decoder_block_types="ResBlock",
                                     encoder_block_out_channels=(8, 16), decoder_block_out_channels=(8, 16),
                                     encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                                     encoder_qkv_multiscales=((), ()), decoder_qkv_multiscales=((), ()),
                                     upsample_block_type="interpolate", downsample_block_type="Conv",
                                     scaling_factor=0.4)
    if path is not None:
        ae.save_pretrained(path)
    return ae.eval()
