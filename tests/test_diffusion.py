"""Sana-style diffusion block, LinDiT, rectified-flow training, sampling and checkpoints."""
import os

import pytest
import torch

from linvision.diffusion.block import CrossAttention, self_attention, SanaBlock
from linvision.diffusion.flow import sample_flow, time_grid
from linvision.diffusion.model import DiTConfig, LinDiT, create_dit
from linvision.diffusion.sampling import sample_classes
from linvision.diffusion.checkpoint import load_dit, save_dit_checkpoint
from linvision.diffusion.train import DiffusionTrainConfig, train_dit
from linvision.ops import axial_rope
from linvision.ops.rope import apply_rope


def _block_inputs(b, hw, c, l=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = hw[0] * hw[1]
    x = torch.randn(b, n, c, generator=g, dtype=dtype)
    t_mod = torch.randn(b, 6 * c, generator=g, dtype=dtype) * 0.5
    context = torch.randn(b, l, c, generator=g, dtype=dtype)
    return x, t_mod, context


def _randomise(module, seed=0):
    """Non-zero values everywhere (the model zero-initialises some projections)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return module


@pytest.mark.parametrize("use_rope,qk_norm", [(False, False), (True, False), (True, True)])
def test_self_attention_equals_explicit_relu_formula(use_rope, qk_norm):
    """o_i = sum_j (R_i phi(q_i)).(R_j phi(k_j)) v_j / N / (sum_j phi(q_i).phi(k_j) / N + eps), phi = relu,
    built with the N x N matrix in float64."""
    torch.manual_seed(0)
    hw, c = (4, 6), 64
    attn = _randomise(self_attention(c, head_dim=32, qk_norm=qk_norm, use_rope=use_rope)).double()
    x = torch.randn(2, hw[0] * hw[1], c, dtype=torch.float64)
    q, k, v = attn.qkv(x).chunk(3, dim=-1)
    if qk_norm:  # Sana's RMS norm over C (the mixer has none without it)
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (t.reshape(2, -1, 2, 32).transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)
    pq, pk = q.relu(), k.relu()
    den = pq @ pk.transpose(-1, -2)  # (B, H, N, N)
    if use_rope:
        rope = axial_rope(32, hw)
        num = apply_rope(pq, rope) @ apply_rope(pk, rope).transpose(-1, -2)
    else:
        num = den
    n = hw[0] * hw[1]
    o = (num / n) @ v / (den.sum(-1, keepdim=True) / n + attn.eps)
    expected = attn.proj(o.transpose(1, 2).reshape(2, n, c))
    torch.testing.assert_close(attn(x, hw), expected, rtol=1e-10, atol=1e-10)


def test_softmax_variant_equals_explicit_softmax():
    torch.manual_seed(0)
    attn = _randomise(self_attention(64, head_dim=32, attn_type="softmax")).double()
    x = torch.randn(1, 12, 64, dtype=torch.float64)
    q, k, v = (t.reshape(1, 12, 2, 32).transpose(1, 2) for t in attn.qkv(x).chunk(3, dim=-1))
    o = torch.softmax(q @ k.transpose(-1, -2) / 32 ** 0.5, dim=-1) @ v
    torch.testing.assert_close(attn(x, (3, 4)), attn.proj(o.transpose(1, 2).reshape(1, 12, 64)))


def test_self_attention_takes_any_registered_mixer():
    """A bidirectional delta-rule (or gated) self-attention is the registered mixer itself: the block's module
    gives, for the same weights, the output of the mixer's own op on its projections (float64), and options
    reach it; flags the mixer has no counterpart for are refused in one line."""
    from linvision.ops import bidirectional_delta_rule_attention

    torch.manual_seed(0)
    hw, c = (4, 6), 64
    attn = _randomise(self_attention(c, head_dim=32, attn_type="bidir_delta", options={"chunk_size": 5})).double()
    assert attn.chunk_size == 5 and attn.qkv.bias is None
    x = torch.randn(2, hw[0] * hw[1], c, dtype=torch.float64)
    q, k, v = (t.reshape(2, -1, 2, 32).transpose(1, 2) for t in attn.qkv(x).chunk(3, dim=-1))
    beta = torch.sigmoid(attn.beta(x)).transpose(1, 2)
    o = bidirectional_delta_rule_attention(q, k, v, beta, attn.feature_map, chunk_size=64)
    expected = attn.proj(o.transpose(1, 2).reshape(2, -1, c))
    torch.testing.assert_close(attn(x, hw), expected, rtol=1e-10, atol=1e-10)
    gated = self_attention(c, head_dim=32, attn_type="bidir_gated", options={"forget_per_channel": True})
    assert gated.forget_per_channel
    with pytest.raises(ValueError, match=r"^self_attn: 'rope' is not an option of the bidir_delta mixer"):
        self_attention(c, head_dim=32, attn_type="bidir_delta", use_rope=True)
    with pytest.raises(ValueError, match=r"^self_attn_options: 'nope' is not an option of the bidir_delta mixer \("):
        self_attention(c, head_dim=32, attn_type="bidir_delta", options={"nope": 1})
    with pytest.raises(ValueError, match="unknown 'nope'"):
        self_attention(c, head_dim=32, attn_type="nope")


def test_dit_with_a_recurrent_mixer_trains_and_reloads(tmp_path):
    """The config's self_attn / self_attn_options build every block's mixer, train, and survive a checkpoint."""
    cfg = dict(_tiny_config().to_dict(), self_attn="bidir_gated", self_attn_options={"chunk_size": 3})
    run = train_dit(DiffusionTrainConfig(model=cfg, steps=20, batch_size=16, lr=3e-3, warmup_steps=2,
                                         log_every=10, save_every=0, seed=0), str(tmp_path / "run"),
                    log=lambda s: None)
    assert run["step"] == 20 and all(torch.isfinite(torch.tensor(run["losses"])))
    model, _ = load_dit(str(tmp_path / "run"), ema=False)
    assert all(type(b.attn).__name__ == "BidirGatedAttention" and b.attn.chunk_size == 3 for b in model.blocks)
    with pytest.raises(ValueError, match="self_attn_options"):
        from linvision.diffusion.sana import config_to_diffusers

        config_to_diffusers(DiTConfig(num_classes=0, caption_channels=8, self_attn_options={"eps": 1e-3}))


def test_block_permutation_equivariance_only_without_mix_ffn():
    hw, c = (4, 4), 64
    x, t_mod, context = _block_inputs(2, hw, c)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    mlp_block = _randomise(SanaBlock(c, 4, ffn="mlp")).double()
    out = mlp_block(x, hw, t_mod, context)
    torch.testing.assert_close(mlp_block(x[:, perm], hw, t_mod, context), out[:, perm], rtol=1e-10, atol=1e-10)
    mix_block = _randomise(SanaBlock(c, 4, ffn="mix")).double()
    out = mix_block(x, hw, t_mod, context)
    diff = (mix_block(x[:, perm], hw, t_mod, context) - out[:, perm]).abs().max()
    assert diff > 1e-2 * out.abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_forward_finite_at_16k_tokens(dtype):
    """128 x 128 tokens with large modulated activations: a sum-form S = sum_j phi(k_j)^T v_j would be far
    beyond the fp16 range (|phi(q).sum_j phi(k_j)| ~ 1e8 here); fp32 mean-form accumulation keeps it finite
    and close to the fp32 forward."""
    torch.manual_seed(0)
    hw, c = (128, 128), 64
    block = SanaBlock(c, 2, cross_attn=True, fp16_clamp=True)
    x, t_mod, context = _block_inputs(1, hw, c, dtype=torch.float32)
    x = x * 100.0
    t_mod = t_mod.view(1, 6, c)
    t_mod[:, 1] = 40.0  # attention input scale: LN(x) * 41
    t_mod = t_mod.view(1, 6 * c)
    with torch.no_grad():
        q, k, _ = block.attn.qkv(block.norm1(x) * 41).chunk(3, dim=-1)
        assert (q.relu() @ k.relu().sum(1).T).max() > 1e6  # the sum form would overflow fp16
        ref = block(x, hw, t_mod, context)
        out = block.to(dtype)(x.to(dtype), hw, t_mod.to(dtype), context.to(dtype))
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref).norm() / ref.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 5e-3)


def test_fp16_clamp_saturates_overflowing_projection():
    attn = self_attention(64, fp16_clamp=True).half()
    with torch.no_grad():
        attn.proj.bias.fill_(6e4)  # outputs near the fp16 limit, pushed over it by the attention term
        attn.proj.weight.fill_(1e2)
        attn.qkv.weight.fill_(0.1)
    x = torch.rand(1, 16, 64).half()  # positive, so are v, the attention output and the added term
    out = attn(x, (4, 4))
    assert torch.isfinite(out).all() and out.abs().max() == 65504
    attn.fp16_clamp = False
    assert torch.isinf(attn(x, (4, 4))).any()
    attn.fp16_clamp = True
    out32 = attn.float()(x.float(), (4, 4))
    assert out32.abs().max() > 65504  # the clamp leaves other dtypes alone


def test_cross_attention_mask():
    torch.manual_seed(0)
    hw, c = (3, 3), 64
    block = _randomise(SanaBlock(c, 4)).double()
    x, t_mod, context = _block_inputs(3, hw, c, l=4)
    mask = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    out = block(x, hw, t_mod, context, mask)
    assert torch.isfinite(out).all()
    # A fully padded condition adds nothing: the row equals the block without cross-attention input.
    torch.testing.assert_close(out[1], block(x[1:2], hw, t_mod[1:2])[0])
    # Padded tokens do not matter, kept ones do; row 0 equals attending to its kept tokens only.
    noisy = context.clone()
    noisy[~mask] = 1e3
    torch.testing.assert_close(block(x, hw, t_mod, noisy, mask), out)
    torch.testing.assert_close(out[0], block(x[:1], hw, t_mod[:1], context[:1, mask[0]])[0])
    changed = context.clone()
    changed[0, 0] += 1.0
    assert (block(x, hw, t_mod, changed, mask)[0] - out[0]).abs().max() > 1e-3
    cross = _randomise(CrossAttention(c, 4)).double()
    assert cross(x, context, torch.zeros(3, 4, dtype=torch.bool)).abs().max() == 0


def test_block_errors():
    block = SanaBlock(64, 4)
    x, t_mod, context = _block_inputs(2, (4, 4), 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="hw"):
        block(x, (4, 5), t_mod)
    with pytest.raises(ValueError, match="t_mod"):
        block(x, (4, 4), t_mod[:, :64])
    with pytest.raises(ValueError, match="context_mask"):
        block(x, (4, 4), t_mod, context, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="context_mask"):
        block(x, (4, 4), t_mod, context, torch.ones(2, 3))
    with pytest.raises(ValueError, match="head_dim"):
        SanaBlock(64, 4, head_dim=24)


def _tiny_config():
    return DiTConfig(img_size=8, in_chans=1, patch_size=2, dim=32, depth=2, num_heads=2, head_dim=16,
                     num_cond_tokens=2)


def test_dit_shapes_and_any_grid():
    model = _randomise(LinDiT(_tiny_config()))
    x = torch.randn(2, 1, 8, 12)  # a non-square grid the model was not built for
    out = model(x, torch.rand(2), torch.tensor([3, 10]))
    assert out.shape == x.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="y"):
        model(x, torch.rand(2), torch.tensor([3, 11]))
    with pytest.raises(ValueError, match="config"):
        create_dit("nope")


def test_sampler_integrates_a_known_flow():
    """For x0 = fixed target a, the exact velocity is (x - a) / t; Euler and Heun reach a."""

    class Exact(torch.nn.Module):
        null_class = 0

        def forward(self, x, t, y):
            return (x - 2.0) / t.view(-1, 1)

    y = torch.zeros(3, dtype=torch.int64)
    for sampler in ("euler", "heun"):
        out = sample_flow(Exact(), y, (5,), steps=7, sampler=sampler, shift=3.0,
                          generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(out, torch.full((3, 5), 2.0))
    grid = time_grid(4, shift=3.0)
    assert grid[0] == 1 and grid[-1] == 0 and (grid.diff() < 0).all()


def _train_cfg(steps):
    return DiffusionTrainConfig(model=_tiny_config().to_dict(), steps=steps, batch_size=32, lr=3e-3,
                                warmup_steps=5, log_every=10, save_every=0, seed=0)


def test_training_lowers_loss_and_resume_is_exact(tmp_path):
    torch.set_num_threads(1)
    full = train_dit(_train_cfg(60), str(tmp_path / "full"), log=lambda s: None)
    assert full["losses"][-1] < 0.8 * full["losses"][0]
    interrupted = train_dit(_train_cfg(60), str(tmp_path / "split"), stop_after=25, log=lambda s: None)
    assert interrupted["step"] == 25
    resumed = train_dit(_train_cfg(60), str(tmp_path / "split"), resume=True, log=lambda s: None)
    assert resumed["step"] == 60
    a, _ = load_dit(str(tmp_path / "full"), ema=False)
    b, _ = load_dit(str(tmp_path / "split"), ema=False)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)


def test_checkpoint_round_trip_gives_identical_samples(tmp_path):
    model = _randomise(LinDiT(_tiny_config())).eval()
    ema = _randomise(LinDiT(_tiny_config()), seed=1).eval()
    save_dit_checkpoint(str(tmp_path / "ck"), model, ema, {"data": {"dataset": "digits"}})
    assert sorted(os.listdir(tmp_path / "ck")) == ["ema.safetensors", "model.json", "model.safetensors"]
    for weights, use_ema in ((ema, True), (model, False)):
        loaded, meta = load_dit(str(tmp_path / "ck"), ema=use_ema)
        assert meta["data"]["dataset"] == "digits"
        want, labels = sample_classes(weights, [0, 7], 2, steps=3, cfg_scale=2.0, seed=5)
        got, _ = sample_classes(loaded, [0, 7], 2, steps=3, cfg_scale=2.0, seed=5)
        assert labels.tolist() == [0, 0, 7, 7]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sample_classification_sees_the_classifier_preprocessing():
    """DiT-side digits (native 8 x 8 in [-1, 1]) reach the classifier as the classification tool's 32 px
    digits do: same images up to uint8 rounding, same normalisation."""
    import numpy as np

    from linvision.diffusion.sampling import classify_images
    from linvision.diffusion.data import load_images
    from linvision.data.datasets import DigitsDataset

    class Capture(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            self.seen = x
            return torch.zeros(x.shape[0], 10)

    x, y, _ = load_images("digits", 8, 1, split="val")
    meta = {"in_chans": 3, "img_size": 32, "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3]}
    clf = Capture()
    classify_images(clf, x[:64], meta, batch_size=64)
    ref = DigitsDataset("val", size=32)
    pixels = torch.from_numpy(np.stack([np.asarray(im) for im in ref.images[:64]])).float().div(255)
    expected = (pixels.permute(0, 3, 1, 2) - torch.tensor(meta["mean"]).view(1, 3, 1, 1)) / torch.tensor(
        meta["std"]).view(1, 3, 1, 1)
    assert y[:64].tolist() == ref.targets[:64]
    torch.testing.assert_close(clf.seen, expected, rtol=0, atol=1.01 / 255 / 0.2)


def test_ema_decay_warms_up_as_the_formula():
    """timm's ModelEmaV3 as the trainer sets it up: after update k, ema = d_k ema + (1 - d_k) model with
    d_k = min(decay, (k + 1) / (k + 10))."""
    from linvision.diffusion.train import create_ema, ema_step

    model = torch.nn.Linear(3, 2).double()
    ema = create_ema(model, 0.95)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for k in range(200):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        ema.update(model, step=ema_step(k))
        d = min(0.95, (k + 1) / (k + 10))
        for n, p in model.named_parameters():
            want[n] = d * want[n] + (1 - d) * p.detach()
    for n, p in ema.module.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=1e-12, atol=1e-12)


def test_optimizer_leaves_modulation_tables_and_vectors_undecayed():
    from timm.optim import create_optimizer_v2

    model = LinDiT(_tiny_config())
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.05 for p in g["params"]}
    assert {"blocks.0.scale_shift_table", "blocks.1.scale_shift_table", "final_layer.scale_shift_table"} <= undecayed
    assert all(model.get_parameter(n).dim() >= 2 and not n.endswith("scale_shift_table") for n in decayed)
    assert "blocks.0.attn.qkv.weight" in decayed and "blocks.0.ffn.expand.weight" in decayed
    assert decayed | undecayed == set(names.values())


def test_tool_flags_are_the_recipe_fields():
    """linvision-train-diffusion (linvision/tools/diffusion.py) builds its recipe flags from DiffusionTrainConfig:
    every field is a flag with the field's default, and flags (and YAML keys) come back as the recipe."""
    from dataclasses import fields

    from linvision.tools import diffusion as tool

    parser = tool.train_parser()
    dests = {a.dest for a in parser._actions}
    names = [f.name for f in fields(DiffusionTrainConfig)]
    assert set(names) <= dests
    assert tool.recipe_from_args(parser.parse_args([])) == DiffusionTrainConfig()
    args = parser.parse_args(["--steps", "7", "--lr", "0.5", "--max-minutes", "2", "--model-kwargs", "depth=3",
                              "--data-dir", "/x"])
    cfg = tool.recipe_from_args(args)
    assert (cfg.steps, cfg.lr, cfg.max_minutes, cfg.model_kwargs, cfg.data_dir) == (7, 0.5, 2.0, {"depth": 3}, "/x")
    assert cfg.model_config().depth == 3
    with pytest.raises(ValueError, match="model config: unknown keys"):
        tool.recipe_from_args(parser.parse_args(["--model-kwargs", "nope=1"]))


def _caption_file(path, count, classes, seed=0):
    """Caption embeddings for the digits: 3 tokens from a per-class table plus noise; odd images pad the last."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    table = torch.randn(10, 3, 6, generator=g)
    context = table[classes] + 0.1 * torch.randn(count, 3, 6, generator=g)
    mask = torch.ones(count, 3, dtype=torch.bool)
    mask[1::2, 2] = False
    save_file({"context": context, "mask": mask}, str(path))
    return context, mask


def test_caption_training_resumes_exactly_and_samples(tmp_path):
    from linvision.diffusion.data import load_images
    from linvision.diffusion.sampling import sample_captions

    torch.set_num_threads(1)
    _, y, _ = load_images("digits", 8, 1)
    context, mask = _caption_file(tmp_path / "captions.safetensors", len(y), y)
    model = {**_tiny_config().to_dict(), "num_classes": 0, "caption_channels": 6}

    def cfg(captions="captions.safetensors"):
        return DiffusionTrainConfig(model=model, captions=str(tmp_path / captions), steps=12, batch_size=16,
                                    warmup_steps=2, log_every=4, save_every=0)

    train_dit(cfg(), str(tmp_path / "full"), log=lambda s: None)
    train_dit(cfg(), str(tmp_path / "split"), stop_after=5, log=lambda s: None)
    train_dit(cfg(), str(tmp_path / "split"), resume=True, log=lambda s: None)
    a, meta = load_dit(str(tmp_path / "full"), ema=False)
    b, _ = load_dit(str(tmp_path / "split"), ema=False)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    assert a.cfg.caption_channels == 6 and meta["data"]["captions"].endswith("captions.safetensors")
    images = sample_captions(a, context[:4], mask[:4], steps=2, cfg_scale=2.0, seed=3)
    again = sample_captions(a, context[:4], mask[:4], steps=2, cfg_scale=2.0, seed=3, batch_size=3)
    assert images.shape == (4, 1, 8, 8)
    torch.testing.assert_close(images, again)
    with pytest.raises(ValueError, match="captions"):
        train_dit(DiffusionTrainConfig(model=model, steps=1), str(tmp_path / "bad"), log=lambda s: None)
    _caption_file(tmp_path / "short.safetensors", 10, y[:10])
    with pytest.raises(ValueError, match="captions: 'context' in .*short.safetensors has shape"):
        train_dit(cfg("short.safetensors"), str(tmp_path / "bad2"), log=lambda s: None)


def test_dropped_caption_is_the_unconditional_velocity():
    """Classifier-free guidance of a caption model: the unconditional half is the caption all padded, whose
    cross-attention adds exactly nothing, so it does not depend on the caption's values; guided velocity is
    v_u + w (v_c - v_u)."""
    from linvision.diffusion.flow import caption_condition, drop_condition, guided_velocity

    torch.manual_seed(0)
    model = _randomise(LinDiT(DiTConfig(**{**_tiny_config().to_dict(), "num_classes": 0, "caption_channels": 6})))
    model = model.double().eval()
    x, t = torch.randn(2, 1, 8, 8, dtype=torch.float64), torch.rand(2, dtype=torch.float64)
    context = torch.randn(2, 3, 6, dtype=torch.float64)
    cond = caption_condition(context)
    null = drop_condition(model, cond, torch.ones(2, dtype=torch.bool))
    v_u = model(x, t, **null)
    torch.testing.assert_close(model(x, t, context=context * 5 + 1, context_mask=null["context_mask"]), v_u)
    v_c = model(x, t, **cond)
    assert (v_c - v_u).abs().max() > 1e-3
    torch.testing.assert_close(guided_velocity(model, x, t, cond, 2.5), v_u + 2.5 * (v_c - v_u))


@pytest.mark.parametrize("tool, args", [("linvision-sample-diffusion", []),
                                        ("linvision-eval-diffusion-samples", ["nowhere_too"])])
def test_sampling_tools_answer_a_missing_checkpoint_in_one_line(tool, args, tmp_path):
    from support import run_tool

    missing = str(tmp_path / "nowhere")
    proc = run_tool(tool, missing, *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
    assert missing in proc.stderr
