"""Every registered token mixer inside a small model, in the modes people run it: train and eval, a forward under
``torch.inference_mode()`` followed by training, fp32 and fp16/bf16 autocast (with a GradScaler step), batch 1 and
an odd non-square grid, channels_last input, gradient checkpointing and ``torch.compile``. Each case checks values:
against the same model in float64 or in fp32, against the batch it was cut from, against a second model that never
saw inference mode, against the eager model."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import linvision  # noqa: F401
from linvision.layers import list_mixers
from linvision.models.linhier import LinHier

MIXERS = list_mixers()
# 40 x 24 px: a 10 x 6 grid after the stride-4 stem, 5 x 3 in the second stage (odd, not square)
IMAGE = (40, 24)
AMP = {"fp16": torch.float16, "bf16": torch.bfloat16}
# autocast against fp32, relative to the largest logit: the projections run in 16 bits (fp16 keeps ~3 decimal
# digits, bf16 ~2); what the ops sum stays fp32, so an overflow or a lost sum is far beyond these
AMP_TOL = {"fp16": 2e-2, "bf16": 8e-2}


def tiny_model(mixer: str, seed: int = 0) -> LinHier:
    """Two stages, one block each, 16 and 32 channels, 2 heads: every mixer registered, built as a model builds it."""
    torch.manual_seed(seed)
    return LinHier(depths=(1, 1), dims=(16, 32), num_heads=(2, 2), token_mixers=mixer, num_classes=5)


def images(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, *IMAGE, generator=torch.Generator().manual_seed(seed))


def labels(batch: int = 2) -> torch.Tensor:
    return torch.arange(batch) % 5


def grads(model: torch.nn.Module):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(model: torch.nn.Module, x: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), labels(x.shape[0]))
    loss.backward()
    return loss.detach(), grads(model)


@functools.lru_cache(maxsize=None)
def fp32_training_reference(mixer: str):
    """(loss, gradients) of one fp32 training step of a fresh ``tiny_model(mixer)``: what the other modes must give
    (computed once per mixer for the whole file)."""
    return loss_and_grads(tiny_model(mixer).train(), images())


def assert_grads_close(got, want, rtol=1e-5, atol=1e-6):
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mixer", MIXERS)
def test_eval_batch1_odd_grid_matches_float64(mixer):
    """Eval on an odd non-square grid: fp32 logits equal the float64 model's, and each image of the batch gets what
    it gets alone (batch 1)."""
    model = tiny_model(mixer).eval()
    x = images()
    with torch.no_grad():
        y = model(x)
        alone = model(x[1:])
        y64 = copy.deepcopy(model).double()(x.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(alone, y[1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("amp", list(AMP))
@pytest.mark.parametrize("mixer", MIXERS)
def test_autocast_forward_and_scaled_training_step(mixer, amp):
    """Under autocast the logits come out in the autocast dtype, finite and within AMP_TOL of fp32; a training step
    with a GradScaler gives finite gradients close in direction to fp32's and finite updated weights."""
    model = tiny_model(mixer)
    x = images()
    model.eval()
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=AMP[amp]):
            y = model(x)
    assert y.dtype == AMP[amp]
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < AMP_TOL[amp]

    model.train()
    _, want = fp32_training_reference(mixer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=AMP[amp]):
        loss = F.cross_entropy(model(x), labels())
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    got = grads(model)
    flat_got = torch.cat([g.flatten() for g in got.values()])
    flat_want = torch.cat([want[n].flatten() for n in got])
    assert torch.isfinite(flat_got).all()
    assert F.cosine_similarity(flat_got.double(), flat_want.double(), dim=0) > 0.98
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 10  # no inf/nan found: the step was taken
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.fixture
def cold_rope_caches():
    """Empty RoPE caches: what a first forward under inference_mode meets in a fresh process (a warm cache from an
    earlier test would hand it tables made outside inference mode and hide the bug)."""
    from linvision.ops import rope

    rope._AXIAL_CACHE.clear()
    rope._POSITION_CACHE.clear()


@pytest.mark.parametrize("mixer", MIXERS)
def test_inference_mode_then_training(mixer, cold_rope_caches):
    """A forward under torch.inference_mode() (which fills the RoPE and position caches) and then a training step:
    the step runs and its gradients equal those of the same model that never saw inference mode."""
    model = tiny_model(mixer)
    x = images()
    with torch.inference_mode():
        model.eval()(x)
        model(x[:1])
    loss, got = loss_and_grads(model.train(), x)
    want_loss, want = fp32_training_reference(mixer)
    torch.testing.assert_close(loss, want_loss)
    assert_grads_close(got, want)


@pytest.mark.parametrize("mixer", MIXERS)
def test_gradient_checkpointing(mixer):
    """Gradient checkpointing (timm's set_grad_checkpointing) gives the gradients of the plain backward."""
    model = tiny_model(mixer).train()
    model.set_grad_checkpointing(True)
    loss, got = loss_and_grads(model, images())
    want_loss, want = fp32_training_reference(mixer)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(got, want)


@pytest.mark.parametrize("mixer", ["linear_rope", "bidir_delta", "none"])
def test_channels_last_input(mixer):
    """channels_last input (the stem's layout, the same for every mixer) gives the loss and gradients of contiguous
    input."""
    loss, got = loss_and_grads(tiny_model(mixer).train(), images().contiguous(memory_format=torch.channels_last))
    want_loss, want = fp32_training_reference(mixer)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # compiling a training step and an eval graph per mixer takes minutes on 2 CPU cores
@pytest.mark.parametrize("mixer", MIXERS)
def test_compile_matches_eager(mixer):
    """torch.compile (inductor) of a training step and of a batch-1 eval forward gives eager's loss, gradients and
    logits. (The models' eval forward under torch.compile runs by default in test_models.)"""
    torch._dynamo.reset()
    model = tiny_model(mixer).train()
    x = images()
    loss, want = fp32_training_reference(mixer)
    compiled = torch.compile(model)
    compiled.zero_grad(set_to_none=True)
    got_loss = F.cross_entropy(compiled(x), labels())
    got_loss.backward()
    torch.testing.assert_close(got_loss.detach(), loss, rtol=1e-4, atol=1e-5)
    assert_grads_close(grads(model), want, rtol=1e-3, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(compiled.eval()(x[:1]), model.eval()(x[:1]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # one dynamic-shape graph per RoPE variant, about 30 s each on 2 CPU cores
@pytest.mark.parametrize("name", ["linvit_tiny_patch16_rope_224", "linvit_small_patch16_rope_mixed_224"])
def test_compile_with_rope_ref_grid_at_other_sizes(name):
    """RoPE positions interpolated to the 4 x 4 training grid (rope_ref_grid=4) under torch.compile(dynamic=True):
    at the training size and at two odd sizes (the scale a symbolic function of the grid) eager's logits."""
    import timm

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=64, depth=2, embed_dim=32, num_heads=2, num_classes=5,
                              mixer_kwargs=dict(rope_ref_grid=4)).eval()
    compiled = torch.compile(model, dynamic=True)
    with torch.no_grad():
        for hw in [(64, 64), (96, 128), (80, 48)]:
            x = torch.randn(1, 3, *hw, generator=torch.Generator().manual_seed(hw[0]))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["linvit_tiny_patch16_rope_224", "linvit_small_patch16_rope_mixed_224"])
def test_vit_models_inference_mode_then_training(name, cold_rope_caches):
    """linvit's RoPE entry points (axial tables cached, mixed ones learnable; 2 blocks): a forward under
    inference_mode, then a training step with the gradients of a copy that never saw inference mode (before,
    "Inference tensors cannot be saved for backward" on linvit_tiny_patch16_rope_224). MLLA's and RAVLT's
    mixers are in the matrix above."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, img_size=32, depth=2)
    fresh = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 32, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model.eval()(x)
    loss, got = loss_and_grads(model.train(), x)
    want_loss, want = loss_and_grads(fresh.train(), x)
    torch.testing.assert_close(loss, want_loss)
    assert_grads_close(got, want)


# position options of the RoPE family, each with the parameter whose gradient is compared
POSITION_OPTIONS = {
    "pos_embed_learn": (dict(pos_embed="learn"), "pos_embed"),
    "rope_origin_centre": (dict(mixer_kwargs=dict(rope_origin="centre")), "blocks.0.mixer.qkv.weight"),
    "rope_ref_grid": (dict(mixer_kwargs=dict(rope_ref_grid=4)), "blocks.0.mixer.qkv.weight"),
}


def _inference_mode_then_autocast_at_100k_tokens(model, param, amp):
    """Batch 1 of an odd non-square image of 100,172 patch tokens (2528 x 2536 px at patch 8), a forward under
    inference_mode, then an fp16/bf16 autocast forward and backward of ``model`` and of a copy that never saw
    inference mode: finite, the logits within the autocast tolerance of fp32, and ``param``'s gradient the copy's."""
    fresh = copy.deepcopy(model)
    x = torch.randn(1, 3, 2528, 2536, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model.eval()(x)
    assert want.shape == (1, 5) and torch.isfinite(want).all()
    grads_of = []
    for m in (model, fresh):
        m.train().zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=AMP[amp]):
            logits = m(x)
        F.cross_entropy(logits.float(), labels(1)).backward()
        grads_of.append(m.get_parameter(param).grad)
        scale = float(want.abs().amax())
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(logits.float(), want, rtol=0, atol=AMP_TOL[amp] * max(scale, 1.0))
    assert torch.isfinite(grads_of[0]).all() and grads_of[0].abs().amax() > 0
    torch.testing.assert_close(grads_of[0], grads_of[1])


@pytest.mark.parametrize("amp", list(AMP))
@pytest.mark.parametrize("option", sorted(POSITION_OPTIONS))
def test_rope_position_options_at_100k_tokens_under_autocast(option, amp, cold_rope_caches):
    """pos_embed='learn' beside axial RoPE, the class token at the grid's centre (rope_origin='centre'), and the
    positions interpolated to the 4 x 4 training grid (rope_ref_grid=4), as a high-resolution user runs them (an
    embedding resampled from that grid): see _inference_mode_then_autocast_at_100k_tokens."""
    import timm

    kwargs, param = POSITION_OPTIONS[option]
    torch.manual_seed(0)
    model = timm.create_model("linvit_tiny_patch16_rope_224", patch_size=8, img_size=32, embed_dim=32, depth=1,
                              num_heads=2, num_classes=5, **kwargs)
    _inference_mode_then_autocast_at_100k_tokens(model, param, amp)


@pytest.mark.parametrize("amp", list(AMP))
def test_pola_entry_point_at_100k_tokens_under_autocast(amp):
    """linvit_*_patch16_pola_224 (class token, learned absolute embedding resampled to every input, PolaFormer's
    mixer with LePE), reduced, as a high-resolution user runs it: see
    _inference_mode_then_autocast_at_100k_tokens; the feature map's power parameter gets the copy's gradient."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("linvit_tiny_patch16_pola_224", patch_size=8, img_size=32, embed_dim=32, depth=1,
                              num_heads=2, num_classes=5, dynamic_img_size=True)
    _inference_mode_then_autocast_at_100k_tokens(model, "blocks.0.mixer.power_logit", amp)


def pooled_and_logits(model, x):
    """(pooled features, logits) of a timm classifier: forward_features, then forward_head with and without
    pre_logits (what model(x) computes, and the features the head reads)."""
    feats = model.forward_features(x)
    return model.forward_head(feats, pre_logits=True), model.forward_head(feats)


def assert_autocast_close(got, want, amp):
    """Autocast's (pooled features, logits) against fp32's: finite, and each within AMP_TOL of fp32 relative to
    fp32's largest value (no floor: an all-zero or constant output is an error of 1 or more)."""
    for what, g, w in zip(("pooled features", "logits"), got, want):
        assert torch.isfinite(g).all(), what
        err = float((g.float() - w.float()).abs().max() / w.float().abs().max())
        assert err < AMP_TOL[amp], f"{what}: autocast differs from fp32 by {err:.3g} of its largest value"


def test_the_autocast_comparison_fails_on_zero_or_constant_outputs(monkeypatch):
    """The comparison the high-resolution tests make cannot pass on a head that returns zeros, or on features
    that are all one value, though such outputs are finite and as small as these models' logits."""
    model = tiny_model("linear").eval()
    x = images(1)
    with torch.no_grad():
        want = pooled_and_logits(model, x)
        assert_autocast_close(pooled_and_logits(model, x), want, "bf16")  # the model against itself passes
        monkeypatch.setattr(model.head.fc, "forward", lambda t: torch.zeros(t.shape[0], 5))
        with pytest.raises(AssertionError, match="logits: autocast differs from fp32 by 1 of"):
            assert_autocast_close(pooled_and_logits(model, x), want, "bf16")
        flat = (torch.full_like(want[0], float(want[0].mean())), want[1])
        with pytest.raises(AssertionError, match="pooled features"):
            assert_autocast_close(flat, want, "bf16")


_SWIN_SMALL = dict(depths=(1, 1, 2, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3))
PUBLISHED_HIGH_RES = {  # reduced; the published layers and mixers as they are; (options, patch stride)
    "vig_tiny": (dict(depth=1, embed_dim=48, num_heads=2), 16),
    "inline_deit_tiny": (dict(depth=1, embed_dim=32, num_heads=2, dynamic_img_size=True), 16),
    "pola_swin_tiny": (_SWIN_SMALL, 4),  # two window blocks in stage 3: one shifted
    "inline_swin_tiny": (_SWIN_SMALL, 4),
    "pola_pvt_tiny": (_SWIN_SMALL, 4),  # PVT: position embeddings resampled to the odd grids
    "inline_pvt_tiny": (_SWIN_SMALL, 4),
    "inline_cswin_tiny": (_SWIN_SMALL, 4),  # CSWin: stripes cut by the odd maps' edges
    "vig_h_tiny": (_SWIN_SMALL, 4),
}


# fp16 for every model by default: a sum over 100k tokens can pass fp16's range (65504), not bf16's (fp32's). bf16
# for one model by default, the others with --runslow (7 cases, about a third of this test's time); bf16's precision
# is checked for every mixer at small size (test_autocast_forward_and_scaled_training_step).
HIGH_RES_CASES = [pytest.param(name, amp, id=f"{name}-{amp}",
                               marks=[pytest.mark.slow] if amp == "bf16" and name != "inline_deit_tiny" else [])
                  for amp in AMP for name in sorted(PUBLISHED_HIGH_RES)]


@pytest.mark.parametrize("name, amp", HIGH_RES_CASES)
def test_published_models_at_100k_tokens_under_autocast(name, amp):
    """ViG, ViG-H, InLine-DeiT, Pola-Swin, InLine-Swin, Pola-PVT, InLine-PVT and InLine-CSwin as a
    high-resolution user fine-tunes them: batch 1 of an odd non-square image of 100,172 tokens at the first stage
    (5056 x 5072 px at patch 16, 1264 x 1268 px at the hierarchical models' 4), a forward under inference_mode,
    then an fp16/bf16 autocast forward and backward: the pooled features and the logits within the autocast
    tolerance of fp32's (relative to their largest value, no floor: the logits are 0.01-0.06 here) and a finite
    gradient for every parameter."""
    import timm

    torch.manual_seed(0)
    options, stride = PUBLISHED_HIGH_RES[name]
    model = timm.create_model(name, num_classes=5, **options)
    x = torch.randn(1, 3, stride * 316, stride * 317, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = pooled_and_logits(model.eval(), x)
    assert want[1].shape == (1, 5) and torch.isfinite(want[1]).all()
    model.train()
    with torch.autocast("cpu", dtype=AMP[amp]):
        got = pooled_and_logits(model, x)
    F.cross_entropy(got[1].float(), labels(1)).backward()
    assert_autocast_close(got, want, amp)
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


PUBLISHED_TINY = ["mlla_tiny", "ravlt_tiny", "mavit_tiny", "vig_tiny", "vig_h_tiny", "inline_deit_tiny",
                  "inline_swin_tiny", "inline_pvt_tiny", "inline_cswin_tiny", "pola_swin_tiny", "pola_pvt_tiny"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the published models at full size on CUDA)")
@pytest.mark.parametrize("amp", list(AMP))
@pytest.mark.parametrize("name", PUBLISHED_TINY)
def test_published_models_on_cuda_under_autocast(name, amp):
    """Every published family's tiny model at full size on CUDA as a high-resolution user fine-tunes it: batch 1
    of a 1000 x 1064 image (not a multiple of 32; 1008 x 1072 for InLine-DeiT, whose patch grid takes multiples
    of 16 only), a forward under inference_mode, then an fp16/bf16 autocast
    forward and backward in training mode (ViG's scans on fla-core's kernels, the CUDA path): finite logits within
    the autocast tolerance of the fp32 training-mode forward (the stems' batch norms use the batch's statistics
    there) and a finite gradient for every parameter."""
    import timm

    torch.manual_seed(0)
    size = (1008, 1072) if name == "inline_deit_tiny" else (1000, 1064)
    options = dict(img_size=size, dynamic_img_size=True) if name == "inline_deit_tiny" else {}
    model = timm.create_model(name, num_classes=5, **options).cuda()
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(3)).cuda()
    with torch.inference_mode():
        assert torch.isfinite(model.eval()(x)).all()
    model.train()
    with torch.no_grad():
        want = model(x).float()
    with torch.autocast("cuda", dtype=AMP[amp]):
        logits = model(x)
    F.cross_entropy(logits.float(), labels(1).cuda()).backward()
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), want, rtol=0, atol=AMP_TOL[amp] * max(float(want.abs().amax()), 1.0))
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


# bf16 and fp16 weights (model.to(dtype), no autocast): every family's reduced model in the dtype against the same
# model in float64, as the norm of the difference relative to the logits' norm. What the ops sum stays fp32 inside
# them; what remains is the 16-bit rounding of the weights and of the activations between the ops (bf16 keeps ~2
# decimal digits, fp16 ~3).
WEIGHT_DTYPES = {"bf16": (torch.bfloat16, 4e-2), "fp16": (torch.float16, 5e-3)}
_HIER = dict(depths=(1, 1, 1, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3))
_VIT = dict(embed_dim=32, depth=2, num_heads=2)
WEIGHTS_FAMILIES = {
    "linvit_tiny_patch16_224": dict(_VIT, dynamic_img_size=True), "linvit_tiny_patch16_pola_224": dict(
        _VIT, dynamic_img_size=True), "linvit_small_patch16_rope_224": _VIT,
    "linvit_small_patch16_rope_mixed_224": _VIT, "inline_deit_tiny": dict(_VIT, dynamic_img_size=True),
    "vig_tiny": _VIT, **{name: _HIER for name in (
        "linhier_tiny_224", "linhier_gcnn_femto_224", "linhier_delta_femto_224", "mlla_tiny", "ravlt_tiny",
        "mavit_tiny", "vig_h_tiny", "inline_swin_tiny", "inline_pvt_tiny", "inline_cswin_tiny", "pola_swin_tiny",
        "pola_pvt_tiny")},
}


def _relative_error(got, want):
    assert got.dtype != torch.float64 and torch.isfinite(got).all()
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("weights", sorted(WEIGHT_DTYPES))
@pytest.mark.parametrize("name", sorted(WEIGHTS_FAMILIES))
def test_half_precision_weights(name, weights):
    """model.to(torch.bfloat16) / .half() for inference, inputs in that dtype: logits of that dtype within its
    rounding of the float64 model's (an odd non-square size, batch 2)."""
    import timm

    dtype, tol = WEIGHT_DTYPES[weights]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **WEIGHTS_FAMILIES[name]).eval()
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.double()(x.double())
        got = model.to(dtype)(x.to(dtype))
    assert got.dtype == dtype
    assert _relative_error(got, want) < tol


@pytest.mark.parametrize("weights", sorted(WEIGHT_DTYPES))
@pytest.mark.parametrize("name", ["linvit_tiny_patch16_pola_224", "linvit_small_patch16_rope_224"])
def test_half_precision_weights_at_100k_tokens(name, weights):
    """bf16 / fp16 weights at 100,172 tokens (batch 1, 2528 x 2536 px at patch 8): the pooled features and logits
    within the dtype's rounding of the fp32 model's, under torch.inference_mode (a sum over 100k tokens in fp16
    would pass 65504: the ops keep their sums in fp32)."""
    import timm

    dtype, tol = WEIGHT_DTYPES[weights]
    torch.manual_seed(0)
    model = timm.create_model(name, patch_size=8, img_size=32, embed_dim=32, depth=1, num_heads=2, num_classes=5,
                              dynamic_img_size=True).eval()
    x = torch.randn(1, 3, 8 * 316, 8 * 317, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = [t.double() for t in pooled_and_logits(model, x)]
        got = pooled_and_logits(model.to(dtype), x.to(dtype))
    for what, g, w in zip(("pooled features", "logits"), got, want):
        assert g.dtype == dtype, what
        assert _relative_error(g, w) < tol, what


@pytest.mark.parametrize("mode", ["autocast-fp16", "autocast-bf16", "bf16-weights"])
def test_fused_epilogue_in_the_modes_people_run(mode, monkeypatch):
    """linhier's linear mixer (RoPE, LePE and the SiLU output gate) on the fused kernels (interpreted on the CPU),
    batch 1 on an odd non-square grid (61 x 67: a case at 100k tokens had not finished after 15 minutes in the
    interpreter; the other tests here run 100k tokens on the PyTorch path): after an inference_mode forward, the
    no-grad output, whose LePE and gate ride in the output kernel's epilogue (no SiLU launched for the gate),
    equals the grad-mode output (the kernels' attention, then LePE and the gate in PyTorch) within the mode's
    rounding, under fp16 and bf16 autocast and with bf16 weights."""
    pytest.importorskip("triton")
    from support import AtenOps

    from linvision.layers import MixerContext, create_mixer
    from linvision.ops.attention import dispatch

    monkeypatch.setattr(dispatch, "_AUTO_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    mixer = create_mixer("linear_rope", 32, 2, gate=True, rope_theta=10000.0).eval()
    x = torch.randn(1, 61 * 67, 32, generator=torch.Generator().manual_seed(1))
    ctx = MixerContext((61, 67))
    amp = mode.startswith("autocast")
    if not amp:
        mixer, x = mixer.to(torch.bfloat16), x.to(torch.bfloat16)
    key = mode[-4:] if amp else "bf16"
    dtype = AMP[key]
    autocast = functools.partial(torch.autocast, "cpu", dtype=dtype, enabled=amp)

    with torch.inference_mode(), autocast():
        first = mixer(x, ctx)
    with torch.no_grad(), autocast(), AtenOps() as ops:
        fused = mixer(x, ctx)
    with autocast(), AtenOps() as plain_ops:
        plain = mixer(x, ctx).detach()
    assert fused.dtype == plain.dtype == dtype and torch.isfinite(fused).all()
    # the gate's SiLU: in the plain path; in the fused call's epilogue without gradients
    assert ops.names["linear_attention_fwd"] == 1 and not ops.names["silu"] and plain_ops.names["silu"]
    torch.testing.assert_close(first, fused, rtol=0, atol=0)
    scale = float(plain.float().abs().amax())
    assert float((fused.float() - plain.float()).abs().amax()) < AMP_TOL[key] / 4 * scale
