"""torch.compile as a first-class mode: every family compiled whole (``fullgraph=True``: a graph break raises), on the
``aot_eager`` backend (TorchDynamo's capture and AOTAutograd's forward and backward graphs,
run by eager kernels; Inductor's code generation is the slow-marked test of tests/test_models.py). Each family's
training step equals eager's (loss and every gradient), and its eval forward, compiled with dynamic shapes, runs at
three sizes from one graph: a change of resolution does not recompile. The training-memory options hold under compile: the recomputing backward
and ``recompute_attend`` are recompute regions of the compiled graph (checkpoints), not dropped."""
import pytest
import timm
import torch
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager

import linvision  # noqa: F401
from linvision.ops import axial_rope, linear_attention

VIT = dict(embed_dim=32, depth=1, num_heads=2)
HIER = dict(depths=(1, 1, 1, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3))
# One model of each family (README's table), reduced; the isotropic ones at patch 16, the hierarchical at 32.
FAMILIES = {
    "linvit_tiny_patch16_224": dict(VIT, dynamic_img_size=True),
    "linvit_tiny_patch16_pola_224": dict(VIT, dynamic_img_size=True),
    "linvit_small_patch16_rope_224": VIT,
    "linvit_small_patch16_rope_mixed_224": VIT,
    "inline_deit_tiny": dict(VIT, dynamic_img_size=True),
    "vig_tiny": VIT,
    "linhier_tiny_224": HIER,
    "linhier_gcnn_femto_224": HIER,
    "linhier_delta_femto_224": HIER,
    "mlla_tiny": HIER,
    "ravlt_tiny": HIER,
    "mavit_tiny": HIER,
    "vig_h_tiny": HIER,
    "inline_swin_tiny": HIER,
    "inline_pvt_tiny": HIER,
    "inline_cswin_tiny": HIER,
    "pola_swin_tiny": HIER,
    "pola_pvt_tiny": HIER,
}
# In the default suite the two entry points README recommends for speed (about a minute each on a busy 2-core
# machine); every family with --runslow.
DEFAULT_FAMILIES = ("linhier_tiny_224", "linvit_tiny_patch16_pola_224")
# Size buckets: InLine-CSwin pads each stage's map to whole stripes (7 wide), and a size whose padding leaves the
# map as it is compiles apart; at most this many eval graphs for the three sizes.
EVAL_GRAPHS = {"inline_cswin_tiny": 2}
# (training size, two other eval sizes): multiples of the patch (16) or of the hierarchy's stride (32), not square
SIZES = {16: [(48, 64), (64, 32), (80, 48)], 32: [(64, 96), (96, 64), (128, 96)]}


def _stride(name):
    return 16 if "patch16" in name or name in ("inline_deit_tiny", "vig_tiny") else 32


class Captured:
    """A torch.compile backend that counts the graphs it is handed and runs them through aot_eager."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)


def _batch(size, seed):
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT_FAMILIES else [pytest.mark.slow])
                                  for n in sorted(FAMILIES)])
def test_family_compiles_whole_and_matches_eager(name):
    """fullgraph=True: a training step (loss, every gradient) equal to eager's within fp32 rounding; then, compiled
    with dynamic=True, the eval forward at three sizes equal to eager's, the second and third size compiling
    nothing new."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **FAMILIES[name]).train()
    sizes = SIZES[_stride(name)]
    x, target = _batch(sizes[0], 0), torch.tensor([1, 3])
    want = F.cross_entropy(model(x), target)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    got = F.cross_entropy(torch.compile(model, backend=Captured(), fullgraph=True)(x), target)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert want_grads and {n for n, p in model.named_parameters() if p.grad is not None} == set(want_grads)
    for n, p in model.named_parameters():
        if n in want_grads:
            torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    torch._dynamo.reset()
    backend = Captured()
    compiled = torch.compile(model.eval(), backend=backend, fullgraph=True, dynamic=True)
    first = None
    with torch.no_grad():
        for i, size in enumerate(sizes):
            x = _batch(size, i + 1)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
            first = first or len(backend.graphs)
    extra = len(backend.graphs) - first
    assert extra <= EVAL_GRAPHS.get(name, 1) - 1, f"{extra} new graphs at the other sizes: a size was specialised"


def _checkpoints(gm):
    """The checkpoint regions at the top level of a captured graph (nested ones sit inside them)."""
    return sum(node.op == "call_function" and "checkpoint" in str(node.target) for node in gm.graph.nodes)


def test_recomputing_backward_holds_under_compile():
    """The reference op's recomputing backward (eager: an autograd.Function that keeps only q, k, v) is, in a
    compiled graph, a checkpoint of the formula: the same values, and a recompute region the backward reruns."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)).requires_grad_()
               for i in range(3))

    def attend(q, k, v):
        return linear_attention(q, k, v, "elu", rope=axial_rope(16, (8, 8)), backend="torch")

    want = attend(q, k, v)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    backend = Captured()
    got = torch.compile(attend, backend=backend, fullgraph=True)(q, k, v)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert [_checkpoints(gm) for gm in backend.graphs] == [1]
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recompute", [True, False])
def test_recompute_attend_holds_under_compile(recompute):
    """``recompute_attend`` (PolaFormer's mixer: on by default) is one checkpoint around the mixer's attention in
    the compiled training graph (the two linear attentions inside it nested in it); switched off, only those two
    remain, each the op's own recompute region; the gradients are eager's either way."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = timm.create_model("linvit_tiny_patch16_pola_224", num_classes=5, dynamic_img_size=True,
                              **VIT).train()
    model.blocks[0].mixer.recompute_attend = recompute
    x = _batch((32, 48), 0)
    model(x).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    backend = Captured()
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    assert [_checkpoints(gm) for gm in backend.graphs] == [1 if recompute else 2]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
