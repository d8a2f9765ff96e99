"""The published families against outputs of their authors' own code: each file of tests/data/golden/ holds a
small model's weights in the authors' checkpoint layout (random values, fixed once), an input and the logits the
authors' model computed from them (their public code, run outside this project; the file's metadata names the
repository, commit, class and arguments). linvision's port, built at the same size and loading that file through
its published-weights path (``pretrained=True`` with the file as the authors' checkpoint), gives those logits.

File layout (safetensors): tensors ``input`` (B, 3, H, W), ``logits`` (B, classes) and ``state.<key>`` for every
tensor of the authors' state dict; metadata ``model`` (the linvision model name), ``kwargs`` (JSON: the keyword
arguments that build the same size here), ``source`` (repository and commit), ``authors`` (their class and
arguments) and ``made`` (how the logits were computed)."""
import json
import os

import pytest
import timm
import torch
from safetensors import safe_open

import linvision  # noqa: F401  (registers the models)

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden")
FILES = sorted(f[:-len(".safetensors")] for f in os.listdir(GOLDEN) if f.endswith(".safetensors")) \
    if os.path.isdir(GOLDEN) else []
META_KEYS = {"model", "kwargs", "source", "authors", "made"}


def _read(name):
    with safe_open(os.path.join(GOLDEN, f"{name}.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("name", FILES)
def test_the_port_gives_the_authors_logits(name, tmp_path):
    tensors, meta = _read(name)
    assert META_KEYS <= set(meta), f"{name}: metadata lacks {sorted(META_KEYS - set(meta))}"
    state = {k[len("state."):]: v for k, v in tensors.items() if k.startswith("state.")}
    assert state and "input" in tensors and "logits" in tensors
    path = tmp_path / "authors.pth"
    torch.save({"model": state}, path)  # as the authors' training scripts save it: the weights under 'model'
    torch.manual_seed(0)
    model = timm.create_model(meta["model"], pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                              **json.loads(meta["kwargs"])).eval()
    with torch.no_grad():
        got = model(tensors["input"])
    want = tensors["logits"]
    assert got.shape == want.shape
    # float32 on both sides, summed in other orders: within 1e-4 of the logits' scale
    scale = want.abs().max().clamp(min=1.0)
    assert (got - want).abs().max() <= 1e-4 * scale, f"{name}: max |diff| {(got - want).abs().max():.3g}"
    # the logits depend on the weights: they are not those of another file's model or of zeros
    assert want.std() > 1e-3


def test_every_published_family_has_its_authors_logits():
    """One file per published family (the name's prefix), so a family added without its authors' logits fails."""
    families = {"mlla", "ravlt", "mavit", "pola_swin", "pola_pvt", "inline_deit", "inline_swin", "inline_pvt",
                "inline_cswin", "vig", "vig_h"}
    have = {meta_model.rsplit("_", 1)[0] for meta_model in (_read(n)[1]["model"] for n in FILES)}
    assert families <= have, f"no authors' logits for {sorted(families - have)}"
