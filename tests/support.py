"""What several test files share: tiny data on disk, the tools run in-process, reading a run's metrics, and the
authors' checkpoint layouts of the published models with the comparisons made on them."""
import collections
import contextlib
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
