"""Sana's transformer: linvision's LinDiT against diffusers' SanaTransformer2DModel (random weights, small
configs built here, no download), the state-dict conversion, diffusers model folders, and the eps forms."""
import json
import os

import pytest
import torch

from linvision.diffusion.model import LinDiT
from linvision.diffusion.sana import (
    config_from_diffusers,
    config_to_diffusers,
    load_diffusers_folder,
    save_diffusers_folder,
    state_dict_from_diffusers,
    state_dict_to_diffusers,
)
from linvision.diffusion.block import sana_attention_class
from linvision.layers import CausalLinearAttention, LinearAttention
from support import SANA_SMALL, diffusers_sana, tiny_autoencoder

SanaLinearAttention = sana_attention_class(LinearAttention)  # LinearAttention with qk_norm and fp16_clamp

diffusers = pytest.importorskip("diffusers")

def _inputs(b=2, hw=(8, 12), l=5, in_chans=4, caption=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, in_chans, *hw, generator=g)
    t = torch.rand(b, generator=g)
    context = torch.randn(b, l, caption, generator=g)
    mask = torch.ones(b, l, dtype=torch.bool)
    mask[0, 3:] = False  # caption 0 pads its last two tokens
    return x, t, context, mask


def _linvision(theirs, exact_eps=True):
    cfg = config_from_diffusers(dict(theirs.config), exact_eps=exact_eps)
    model = LinDiT(cfg).eval()
    model.load_state_dict(state_dict_from_diffusers(theirs.state_dict(), cfg))
    return model


def _theirs_forward(model, x, t, context, mask, guidance=None):
    # diffusers' timestep is 1000 t, linvision's t in [0, 1]; both compute 1000 * t in fp32 the same way
    with torch.no_grad():
        return model(x, context, 1000.0 * t, guidance=guidance, encoder_attention_mask=mask.long(),
                     return_dict=False)[0]


@pytest.mark.parametrize("qk_norm,guidance", [(None, False), ("rms_norm_across_heads", True)])
def test_same_output_as_diffusers_with_a_padded_caption_on_a_non_square_grid(qk_norm, guidance):
    """fp32, exact eps: float rounding apart the same output (max abs error below 2e-6 on outputs of size ~2;
    3.6e-7 measured);
    padded caption tokens change neither model."""
    theirs = diffusers_sana(qk_norm=qk_norm, guidance_embeds=guidance)
    ours = _linvision(theirs)
    x, t, context, mask = _inputs()
    g = torch.tensor([4.5, 2.0]) if guidance else None
    want = _theirs_forward(theirs, x, t, context, mask, g)
    with torch.no_grad():
        got = ours(x, t, context=context, context_mask=mask, guidance=g)
        noisy = context.clone()
        noisy[~mask] = 100.0
        got_noisy = ours(x, t, context=noisy, context_mask=mask, guidance=g)
    assert got.shape == want.shape == x.shape and want.abs().mean() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_noisy, got, rtol=0, atol=2e-6)
    # the padding matters to the result: without the mask the output moves
    with torch.no_grad():
        assert (ours(x, t, context=noisy, guidance=g) - got).abs().max() > 1e-2


def test_default_eps_is_the_sum_form_with_n_times_eps():
    """linvision's default (mean form, 1e-4) equals diffusers' sum form with eps N * 1e-4: patching that eps into
    diffusers' processor reproduces linvision's default output; with diffusers' own 1e-15 the two differ."""
    from diffusers.models import attention_processor as ap

    theirs = diffusers_sana()
    ours = _linvision(theirs, exact_eps=False)
    assert ours.cfg.eps == 1e-4 and ours.cfg.eps_form == "mean"
    x, t, context, mask = _inputs()
    n = (x.shape[2] // 2) * (x.shape[3] // 2)
    with torch.no_grad():
        got = ours(x, t, context=context, context_mask=mask)
    exact = _theirs_forward(theirs, x, t, context, mask)

    source = ap.SanaLinearAttnProcessor2_0.__call__
    import inspect
    import textwrap

    code = textwrap.dedent(inspect.getsource(source)).replace("+ 1e-15)", f"+ {n * 1e-4!r})")
    assert f"+ {n * 1e-4!r})" in code
    namespace = dict(vars(ap))
    exec(compile(code, ap.__file__, "exec"), namespace)
    original = ap.SanaLinearAttnProcessor2_0.__call__
    ap.SanaLinearAttnProcessor2_0.__call__ = namespace["__call__"]
    try:
        patched = _theirs_forward(theirs, x, t, context, mask)
    finally:
        ap.SanaLinearAttnProcessor2_0.__call__ = original
    torch.testing.assert_close(got, patched, rtol=0, atol=1e-5)
    assert (got - exact).abs().max() > 1e-4


def test_conversion_round_trip_is_lossless():
    theirs = diffusers_sana(qk_norm="rms_norm_across_heads", guidance_embeds=True)
    cfg = config_from_diffusers(dict(theirs.config))
    state = theirs.state_dict()
    back = state_dict_to_diffusers(state_dict_from_diffusers(state, cfg), cfg)
    assert sorted(back) == sorted(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    config = config_to_diffusers(cfg)
    assert {k: config[k] for k in SANA_SMALL} == SANA_SMALL
    assert config_from_diffusers(config) == cfg


def test_diffusers_save_pretrained_folder_loads_and_saves_back(tmp_path):
    theirs = diffusers_sana(qk_norm="rms_norm_across_heads")
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").exists()
    ours = load_diffusers_folder(str(tmp_path / "sharded"), exact_eps=True)
    x, t, context, mask = _inputs()
    want = _theirs_forward(theirs, x, t, context, mask)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, t, context=context, context_mask=mask), want, rtol=0, atol=1e-5)
    # linvision writes the folder back; diffusers loads it (single file and sharded) to the same weights
    for name, shard in (("single", None), ("shards", 30_000)):
        save_diffusers_folder(ours, str(tmp_path / name), max_shard_bytes=shard)
        again = diffusers.SanaTransformer2DModel.from_pretrained(str(tmp_path / name), low_cpu_mem_usage=False)
        public = [k for k in theirs.config if not k.startswith("_")]
        assert {k: again.config[k] for k in public} == {k: theirs.config[k] for k in public}
        for k, v in theirs.state_dict().items():
            assert torch.equal(again.state_dict()[k], v), k
    assert len([f for f in os.listdir(tmp_path / "shards") if f.endswith(".safetensors")]) > 1


def test_folder_errors_name_the_file_and_the_key(tmp_path):
    theirs = diffusers_sana()
    theirs.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    folder = tmp_path / "m"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    key = next(k for k, v in index["weight_map"].items() if v == shard)
    os.rename(folder / shard, tmp_path / "aside")
    with pytest.raises(FileNotFoundError, match=f"{shard} is missing.*{key}"):
        load_diffusers_folder(str(folder))
    os.rename(tmp_path / "aside", folder / shard)

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    with pytest.raises(ValueError, match="transformer_blocks.2.attn1.to_q.weight"):
        load_diffusers_folder(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "caption_channels": 20}))
    with pytest.raises(ValueError, match=r"diffusion_pytorch_model-\d+-of-\d+.safetensors: 'caption_projection."
                                         r"linear_1.weight' has shape \(16, 12\).*config.json"):
        load_diffusers_folder(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "interpolation_scale": 1.0}))
    with pytest.raises(ValueError, match="config.json: interpolation_scale"):
        load_diffusers_folder(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "_class_name": "PixArtTransformer2DModel"}))
    with pytest.raises(ValueError, match="config.json: _class_name"):
        load_diffusers_folder(str(folder))
    (folder / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_diffusers_folder(str(folder))
    os.remove(folder / "config.json")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_diffusers_folder(str(folder))


@pytest.mark.parametrize("rope", [None, "axial"])
def test_sum_eps_form_is_the_explicit_sum_formula(rope):
    """o_i = sum_j (R phi(q_i)).(R phi(k_j)) v_j / (sum_j phi(q_i).phi(k_j) + eps) in float64, eps 2 (large
    enough to matter against the RMS-normalised features), against the mixer with eps_form='sum'."""
    from linvision.ops import axial_rope
    from linvision.ops.rope import apply_rope

    torch.manual_seed(0)
    hw, c, heads = (3, 5), 16, 2
    mixer = SanaLinearAttention(c, heads, feature_map="relu", eps=2.0, eps_form="sum", rope=rope,
                                qk_norm=True, qkv_bias=False).double()
    x = torch.randn(2, 15, c, dtype=torch.float64)
    q, k, v = mixer.qkv(x).chunk(3, dim=-1)
    q, k = mixer.q_norm(q), mixer.k_norm(k)
    q, k, v = (t.reshape(2, 15, heads, 8).transpose(1, 2) for t in (q, k, v))
    pq, pk = q.relu(), k.relu()
    den = (pq @ pk.transpose(-1, -2)).sum(-1, keepdim=True)
    if rope:
        r = axial_rope(8, hw)
        num = apply_rope(pq, r) @ apply_rope(pk, r).transpose(-1, -2)
    else:
        num = pq @ pk.transpose(-1, -2)
    o = num @ v / (den + 2.0)
    want = mixer.proj(o.transpose(1, 2).reshape(2, 15, c))
    torch.testing.assert_close(mixer(x, hw), want, rtol=1e-10, atol=1e-12)
    mean = SanaLinearAttention(c, heads, feature_map="relu", eps=2.0, rope=rope, qk_norm=True,
                               qkv_bias=False).double()
    mean.load_state_dict(mixer.state_dict())
    assert (mean(x, hw) - want).abs().max() > 1e-2  # the mean form with the same eps is another function
    with pytest.raises(ValueError, match="eps_form"):
        CausalLinearAttention(c, heads, eps_form="sum")
    with pytest.raises(ValueError, match="eps_form"):
        LinearAttention(c, heads, eps_form="max")


def test_sum_eps_form_is_finite_in_half_precision():
    """diffusers' eps 1e-15 in the sum form: with fp16 inputs at 64 x 64 tokens the fp32 mean-form accumulation
    keeps the output finite and close to the fp32 result."""
    torch.manual_seed(0)
    mixer = SanaLinearAttention(64, 2, feature_map="relu", eps=1e-15, eps_form="sum", qkv_bias=False,
                                fp16_clamp=True)
    x = torch.randn(1, 4096, 64) * 30
    with torch.no_grad():
        ref = mixer(x, (64, 64))
        out = mixer.half()(x.half(), (64, 64))
    assert torch.isfinite(out).all()
    assert (out.float() - ref).norm() / ref.norm() < 5e-3


@pytest.mark.parametrize("kind", ["AutoencoderKL", "AutoencoderDC"])
def test_latents_are_scaled_as_diffusers_pipelines_scale_them(tmp_path, kind):
    from linvision.diffusion.latents import autoencoder_geometry, decode_latents, encode_images, load_autoencoder

    tiny_autoencoder(kind, tmp_path / "ae")
    ae = load_autoencoder(str(tmp_path / "ae"))
    assert type(ae).__name__ == kind and autoencoder_geometry(ae) == (3, 4, 2)
    x = torch.rand(3, 3, 16, 12) * 2 - 1
    z = encode_images(ae, x, batch_size=2)
    with torch.no_grad():
        if kind == "AutoencoderKL":
            want = (ae.encode(x).latent_dist.mean - 0.1) * 0.5
            images = ae.decode(z / 0.5 + 0.1).sample
        else:
            want = ae.encode(x).latent * 0.4
            images = ae.decode(z / 0.4).sample
    assert z.shape == (3, 4, 8, 6)
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decode_latents(ae, z), images, rtol=1e-5, atol=1e-6)
    (tmp_path / "ae" / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ValueError, match="UNet2DModel"):
        load_autoencoder(str(tmp_path / "ae"))


def test_latent_training_resumes_exactly_and_samples_decode_to_images(tmp_path):
    from linvision.diffusion.checkpoint import load_dit
    from linvision.diffusion.data import load_images
    from linvision.diffusion.latent_cache import LatentCache
    from linvision.diffusion.latents import encode_images, load_autoencoder
    from linvision.diffusion.sampling import decoder_for, sample_classes
    from linvision.diffusion.train import DiffusionTrainConfig, train_dit

    torch.set_num_threads(1)
    tiny_autoencoder("AutoencoderKL", tmp_path / "ae")
    model = dict(img_size=8, in_chans=4, patch_size=2, dim=32, depth=1, num_heads=2, head_dim=16, num_cond_tokens=2)

    def cfg():
        return DiffusionTrainConfig(model=model, autoencoder=str(tmp_path / "ae"), steps=12, batch_size=16,
                                    warmup_steps=2, log_every=4, save_every=0, encode_batch_size=256)

    train_dit(cfg(), str(tmp_path / "full"), log=lambda s: None)
    assert train_dit(cfg(), str(tmp_path / "split"), stop_after=5, log=lambda s: None)["step"] == 5
    assert train_dit(cfg(), str(tmp_path / "split"), resume=True, log=lambda s: None)["step"] == 12
    a, meta = load_dit(str(tmp_path / "full"), ema=False)
    b, _ = load_dit(str(tmp_path / "split"), ema=False)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    # the cache holds the autoencoder's latents of the 16 px digits (grey repeated to RGB)
    cached = LatentCache(str(tmp_path / "full" / "latents")).latents(range(64))
    images, _, _ = load_images("digits", 16, 1)
    ae = load_autoencoder(str(tmp_path / "ae"))
    torch.testing.assert_close(cached[:64], encode_images(ae, images[:64].expand(-1, 3, -1, -1)))
    assert meta["data"]["autoencoder"] == os.path.abspath(tmp_path / "ae")
    samples, labels = sample_classes(a, [0, 3], 2, steps=2, decode=decoder_for(meta))
    assert samples.shape == (4, 3, 16, 16) and labels.tolist() == [0, 0, 3, 3]
    assert samples.abs().max() <= 1 and samples.std() > 0
    with pytest.raises(ValueError, match="in_chans"):
        train_dit(DiffusionTrainConfig(model={**model, "in_chans": 3}, autoencoder=str(tmp_path / "ae"), steps=1),
                  str(tmp_path / "bad"), log=lambda s: None)


def _assert_diffusers_runs_it_alike(tuned, folder):
    """``tuned`` (a 1-channel caption LinDiT, exact eps) written as a diffusers folder loads in diffusers and gives
    linvision's output."""
    save_diffusers_folder(tuned, str(folder))
    again = diffusers.SanaTransformer2DModel.from_pretrained(str(folder), low_cpu_mem_usage=False).eval()
    x, t, context, mask = _inputs(in_chans=1, caption=6)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x, t, context=context, context_mask=mask),
                                   _theirs_forward(again, x, t, context, mask), rtol=0, atol=2e-6)


def test_fine_tuning_starts_from_a_diffusers_folder_and_goes_back(tmp_path):
    """--init-from: the run starts from the folder's weights (after two steps at lr 1e-7 every tensor is within
    1e-5 of them, while the model's own init is far); the fine-tuned checkpoint written back as a diffusers folder
    loads in diffusers and gives linvision's output (exact eps)."""
    from safetensors.torch import save_file

    from linvision.diffusion.checkpoint import load_dit
    from linvision.diffusion.data import load_images
    from linvision.diffusion.train import DiffusionTrainConfig, train_dit

    torch.set_num_threads(1)
    theirs = diffusers_sana(in_channels=1, out_channels=1, caption_channels=6)
    theirs.save_pretrained(tmp_path / "sana")
    _, y, _ = load_images("digits", 8, 1)
    g = torch.Generator().manual_seed(0)
    save_file({"context": torch.randn(len(y), 3, 6, generator=g), "mask": torch.ones(len(y), 3, dtype=torch.bool)},
              str(tmp_path / "captions.safetensors"))
    cfg = DiffusionTrainConfig(init_from=str(tmp_path / "sana"), captions=str(tmp_path / "captions.safetensors"),
                               model_kwargs={"eps": 1e-15, "eps_form": "sum"}, steps=2, batch_size=8, lr=1e-7,
                               warmup_steps=0, log_every=1, save_every=0)
    train_dit(cfg, str(tmp_path / "ft"), log=lambda s: None)
    tuned, _ = load_dit(str(tmp_path / "ft"), ema=False)
    start = state_dict_from_diffusers(theirs.state_dict(), tuned.cfg)
    fresh = LinDiT(tuned.cfg).state_dict()
    for k, v in tuned.state_dict().items():
        torch.testing.assert_close(v, start[k], rtol=0, atol=1e-5, msg=k)
    assert max((fresh[k] - start[k]).abs().max() for k in start) > 0.1
    _assert_diffusers_runs_it_alike(tuned, tmp_path / "back")


def test_latent_cache_keeps_finished_shards_after_a_kill_and_refuses_another_source(tmp_path):
    """A build killed after three shards leaves them (and no cache.json); the next build encodes only the four
    missing ones, a third encodes nothing; the cache reads back the autoencoder's latents row by row."""
    from linvision.diffusion.data import ImageSet
    from linvision.diffusion.latent_cache import LatentCache, build_latent_cache
    from linvision.diffusion.latents import encode_images

    ae = tiny_autoencoder("AutoencoderKL")
    data = ImageSet("digits", 16, 1)
    source = {"autoencoder": "tiny", "dataset": "digits", "image_size": 16}
    calls = []

    def encode(x):
        calls.append(len(x))
        if killed and len(calls) > 3:
            raise KeyboardInterrupt  # as a kill would stop the run
        return encode_images(ae, x.expand(-1, 3, -1, -1))

    folder = str(tmp_path / "cache")
    killed = True
    with pytest.raises(KeyboardInterrupt):
        build_latent_cache(folder, source, 100, data.images, encode, shard_size=16, log=lambda s: None)
    assert sorted(n for n in os.listdir(folder) if n.startswith("latents-")) == [
        f"latents-{i:05d}.safetensors" for i in range(3)]
    with pytest.raises(FileNotFoundError, match="not a complete latent cache"):
        LatentCache(folder)
    killed, calls = False, []
    build_latent_cache(folder, source, 100, data.images, encode, shard_size=16, log=lambda s: None)
    assert calls == [16, 16, 16, 4]  # shards 3..6; the last holds images 96..99
    calls = []
    build_latent_cache(folder, source, 100, data.images, encode, shard_size=16, log=lambda s: None)
    assert calls == []
    cache = LatentCache(folder)
    want = encode_images(ae, data.images(range(100)).expand(-1, 3, -1, -1))
    idx = torch.tensor([99, 0, 17, 17, 63])
    torch.testing.assert_close(cache.latents(idx), want[idx], rtol=1e-5, atol=1e-6)
    assert len(cache) == 100 and cache.latent_shape == [4, 8, 8]
    with pytest.raises(ValueError, match="outside the cache's 100 images"):
        cache.latents([100])
    with pytest.raises(ValueError, match="image_size=16, this run asks for 32"):
        build_latent_cache(folder, {**source, "image_size": 32}, 100, data.images, encode, log=lambda s: None)


def test_latents_encoded_per_batch_train_as_cached_ones_and_a_named_cache_is_reused(tmp_path):
    """cache_latents off encodes each batch (no cache written) and trains to the cached run's weights; a second
    run naming the first run's cache encodes nothing."""
    from linvision.diffusion.checkpoint import load_dit
    from linvision.diffusion.train import DiffusionTrainConfig, train_dit

    torch.set_num_threads(1)
    tiny_autoencoder("AutoencoderKL", tmp_path / "ae")
    model = dict(img_size=8, in_chans=4, patch_size=2, dim=32, depth=1, num_heads=2, head_dim=16, num_cond_tokens=2)

    def cfg(**kw):
        return DiffusionTrainConfig(model=model, autoencoder=str(tmp_path / "ae"), steps=3, batch_size=8,
                                    warmup_steps=2, log_every=1, save_every=0, encode_batch_size=512, **kw)

    logs = []
    train_dit(cfg(), str(tmp_path / "cached"), log=logs.append)
    assert any(s.startswith("latent cache: shard 2/2") for s in logs)
    train_dit(cfg(cache_latents=False), str(tmp_path / "direct"), log=lambda s: None)
    assert not (tmp_path / "direct" / "latents").exists()
    logs = []
    train_dit(cfg(latent_cache=str(tmp_path / "cached" / "latents")), str(tmp_path / "reuse"), log=logs.append)
    assert not any(s.startswith("latent cache") for s in logs) and not (tmp_path / "reuse" / "latents").exists()
    a, _ = load_dit(str(tmp_path / "cached"), ema=False)
    for other in ("direct", "reuse"):
        b, _ = load_dit(str(tmp_path / other), ema=False)
        for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
            torch.testing.assert_close(pb, pa, rtol=0, atol=1e-5, msg=f"{other}: {name}")


def test_a_sharded_fine_tuning_checkpoint_exports_to_a_diffusers_folder(tmp_path):
    """A caption model fine-tuned with --parallel fsdp (one rank, fp32) leaves a torch.distributed.checkpoint;
    load_dit reads it in a plain process and save_diffusers_folder writes what diffusers loads and runs alike."""
    from safetensors.torch import save_file

    from linvision.diffusion.checkpoint import is_sharded_checkpoint, load_dit
    from linvision.diffusion.train import DiffusionTrainConfig, train_dit

    torch.set_num_threads(1)
    theirs = diffusers_sana(in_channels=1, out_channels=1, caption_channels=6)
    theirs.save_pretrained(tmp_path / "sana")
    g = torch.Generator().manual_seed(0)
    save_file({"context": torch.randn(1437, 3, 6, generator=g), "mask": torch.ones(1437, 3, dtype=torch.bool)},
              str(tmp_path / "captions.safetensors"))
    cfg = DiffusionTrainConfig(init_from=str(tmp_path / "sana"), captions=str(tmp_path / "captions.safetensors"),
                               model_kwargs={"eps": 1e-15, "eps_form": "sum"}, steps=2, batch_size=4,
                               warmup_steps=0, log_every=1, save_every=0, parallel="fsdp", fsdp_param_dtype="fp32")
    train_dit(cfg, str(tmp_path / "ft"), log=lambda s: None)
    assert is_sharded_checkpoint(str(tmp_path / "ft" / "last"))
    tuned, _ = load_dit(str(tmp_path / "ft"))
    start = state_dict_from_diffusers(theirs.state_dict(), tuned.cfg)
    assert max((v - start[k]).abs().max() for k, v in tuned.state_dict().items()) > 1e-6  # it trained
    _assert_diffusers_runs_it_alike(tuned, tmp_path / "back")
