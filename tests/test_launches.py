"""What the host pays per forward: the device launches of one eval forward of each family's model at 224 px, batch
1, with the attention on the fused op, counted as a GPU would launch them (tests/support.py's DeviceLaunches: one
launch per computing aten op and per fused call; views and allocations none). Each family's count is held as a
ceiling, so a change that adds launches to a block shows here. The inference folds that removed some of them
(linvision.layers.derived: the gate's projection in the qkv product, the conv position encoding's residual in its
kernel, PolaFormer's divisor and power formed once) give the plain path's outputs, and follow the weights when
they change; so does the fused output pass of the linear mixers, which adds LePE and applies the output gate in
the kernel's epilogue."""
import pytest
import timm
import torch
import torch.nn.functional as F

import linvision  # noqa: F401
from linvision.ops.attention import dispatch
from support import DeviceLaunches

# Launches per eval forward at 224 px, batch 1: the ceilings. The recurrent families (vig, vig_h, linhier_delta)
# count their scans' PyTorch path (on a GPU fla-core's kernels run them).
CEILINGS = {
    "linvit_tiny_patch16_224": 125,
    "linvit_tiny_patch16_pola_224": 245,
    "linvit_small_patch16_rope_224": 148,
    "linvit_small_patch16_rope_mixed_224": 148,
    "inline_deit_tiny": 569,
    "vig_tiny": 1862,
    "linhier_tiny_224": 287,
    "linhier_gcnn_femto_224": 179,
    "linhier_delta_femto_224": 1637,
    "mlla_tiny": 395,
    "ravlt_tiny": 430,
    "mavit_tiny": 498,
    "vig_h_tiny": 2416,
    "inline_swin_tiny": 567,
    "inline_pvt_tiny": 382,
    "inline_cswin_tiny": 815,
    "pola_swin_tiny": 558,
    "pola_pvt_tiny": 190,
}


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused kernels take CPU tensors, as CUDA ones on a GPU (the counting mode never runs them)."""
    monkeypatch.setattr(dispatch, "_AUTO_DEVICES", ("cuda", "cpu"))


def launches(model, x):
    """The launches of ``model(x)`` without gradients, after a first forward (which forms the cached tables and
    folds)."""
    with torch.no_grad():
        with DeviceLaunches():
            model(x)
        with DeviceLaunches() as mode:
            model(x)
    return mode


@pytest.mark.parametrize("name", sorted(CEILINGS))
def test_launches_per_forward_within_ceiling(name, fused_on_cpu):
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    mode = launches(model, torch.randn(1, 3, 224, 224))
    fused = sum(n for op, n in mode.names.items() if op.startswith("linvision::"))
    assert fused > 0 or "gcnn" in name or name.startswith(("vig", "linhier_delta")), mode.names
    assert mode.total <= CEILINGS[name], f"{mode.total} launches per forward, above {CEILINGS[name]}: {mode.names}"


def test_the_counting_sees_each_launch(fused_on_cpu):
    """The counter counts what runs: a linear layer and a GELU are two launches, views none, a fused call one."""
    from linvision.ops import linear_attention

    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with DeviceLaunches() as mode:
        F.gelu(layer(x)).reshape(4, 4).transpose(0, 1)
    assert mode.total == 2, mode.names
    q = torch.randn(1, 2, 16, 16)
    with DeviceLaunches() as mode:
        linear_attention(q, q, q, "elu")
    assert mode.names["linvision::linear_attention_fwd"] == 1


FOLDED = {  # a reduced model of each fold: (name, options, the module whose weights a training step changes)
    "gate in qkv": ("linhier_tiny_224", dict(depths=(1, 1, 1, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3))),
    "conv position encoding": ("mlla_tiny", dict(depths=(1, 1, 1, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3))),
    "polarity scale and power": ("linvit_tiny_patch16_pola_224", dict(embed_dim=32, depth=2, num_heads=2,
                                                                      dynamic_img_size=True)),
}


@pytest.mark.parametrize("case", sorted(FOLDED))
def test_inference_folds_follow_the_weights(case):
    """Eval without gradients (the folds formed once, under inference_mode first) equals eval with gradients
    wanted (the plain ops, as in training) to fp32 rounding; after a training step changes the weights in place, and after load_state_dict,
    the folds are formed anew: eval equals the plain path again, and differs from the output before the step."""
    name, options = FOLDED[case]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **options)
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(1))

    def both():
        model.eval()
        with torch.inference_mode():  # formed here, the folds are ordinary tensors the no_grad forward reuses
            inference = model(x)
        with torch.no_grad():
            folded = model(x)
        plain = model(x).detach()  # grad mode: no fold
        torch.testing.assert_close(folded, plain, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(inference, folded, rtol=0, atol=0)
        return folded

    before = both()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    F.cross_entropy(model(x), torch.tensor([1, 2])).backward()
    opt.step()
    after = both()
    assert (after - before).abs().max() > 1e-3
    state = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    loaded = both()
    assert (loaded - after).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["linhier_tiny_224", "mlla_tiny", "linvit_small_patch16_rope_224"])
def test_epilogue_gives_the_plain_path_and_saves_its_launches(name, fused_on_cpu):
    """Without gradients the linear mixers hand LePE's branch and the output gate to the fused kernels' epilogue:
    the model's output equals the plain path (gradients wanted: the kernels' attention, then LePE's add and the
    gate in PyTorch) to fp32 rounding, and its forward launches no add for LePE and no SiLU or multiply for the
    gate (linhier: none of them at all, every block's LePE and gate in the epilogue)."""
    torch.manual_seed(0)
    small = dict(depths=(1, 1, 1, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3)) if "vit" not in name else \
        dict(embed_dim=32, depth=2, num_heads=2, dynamic_img_size=True)
    model = timm.create_model(name, num_classes=5, **small).eval()
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = model(x)
    plain = model(x).detach()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    mode = launches(model, x)
    plain_mode = DeviceLaunches()
    with plain_mode:
        model(x)
    blocks = mode.names["linvision::linear_attention_fwd"]
    assert blocks > 0 and mode.total < plain_mode.total
    if name == "linhier_tiny_224":
        assert mode.names["silu"] == 0 and mode.names["mul"] == 0 and plain_mode.names["silu"] == blocks
