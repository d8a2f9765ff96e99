"""diffusers' SanaPipeline with linvision's transformer (LinSanaTransformer2DModel): the same latents and images as
with diffusers' SanaTransformer2DModel, pipeline and model folders, linvision checkpoints, and the errors. A tiny
random pipeline built here (no download): no tokenizer or text encoder, prompt embeddings passed directly."""
import json
import os
import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")  # SanaPipeline is a dummy without it

from linvision.diffusion.checkpoint import save_dit_checkpoint  # noqa: E402
from linvision.diffusion.model import LinDiT, create_dit  # noqa: E402
from linvision.diffusion.pipeline import LinSanaTransformer2DModel  # noqa: E402
from linvision.diffusion.sana import load_diffusers_folder  # noqa: E402
from support import SANA_SMALL, diffusers_sana, randomize, tiny_autoencoder  # noqa: E402

SIZE = dict(height=64, width=32)  # the pipeline needs multiples of 32; latents 32 x 16 (the autoencoder's 2x)


def _scheduler(kind):
    if kind == "euler":
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    # Sana's own: DPM-Solver++ on flow sigmas
    return diffusers.DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True,
                                                 prediction_type="flow_prediction")


def _pipeline(transformer, vae, scheduler="euler"):
    pipe = diffusers.SanaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                  scheduler=_scheduler(scheduler))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _prompts(caption=12):
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])  # 0/1 as a tokenizer gives; prompt 0 pads 2 tokens
    return dict(prompt_embeds=torch.randn(2, 5, caption, generator=g), prompt_attention_mask=mask,
                negative_prompt_embeds=torch.randn(2, 5, caption, generator=g),
                negative_prompt_attention_mask=torch.tensor([[1, 1, 0, 0, 0]] * 2))


def _run(pipe, guidance_scale=4.5, output_type="latent", steps=3):
    # negative_prompt=None: the pipeline refuses its default "" beside negative_prompt_embeds
    return pipe(**_prompts(), negative_prompt=None, guidance_scale=guidance_scale, num_inference_steps=steps,
                use_resolution_binning=False, output_type=output_type, generator=torch.Generator().manual_seed(0),
                **SIZE).images


def _max_err(got, want):
    """max |got - want| relative to the output's scale (its max |value|)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(diffusers' transformer, its folder, linvision's transformer from that folder, a tiny AutoencoderDC)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("sana") / "transformer"
    theirs = diffusers_sana()
    theirs.save_pretrained(folder)
    vae = tiny_autoencoder("AutoencoderDC")
    ours = LinSanaTransformer2DModel.from_pretrained(folder, exact_eps=True)
    return theirs, folder, ours, vae


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # diffusers' DPM scheduler, numpy 2
@pytest.mark.parametrize("scheduler", ["euler", "dpm"])
def test_pipeline_gives_diffusers_latents_and_images(parts, scheduler):
    """fp32, exact eps, a non-square size, padded prompts, with and without classifier-free guidance: the same
    latents and decoded images (relative max error below 1e-5; measured about 5e-7)."""
    theirs, _, ours, vae = parts
    latents = {}
    for scale in (4.5, 1.0):
        want, got = (_run(_pipeline(t, vae, scheduler), scale) for t in (theirs, ours))
        assert got.shape == want.shape == (2, 4, 32, 16) and want.abs().max() > 1
        assert _max_err(got, want) < 1e-5
        latents[scale] = want
        want, got = (_run(_pipeline(t, vae, scheduler), scale, output_type="pt") for t in (theirs, ours))
        assert got.shape == want.shape == (2, 3, 64, 32) and want.std() > 0.05
        assert _max_err(got, want) < 1e-5
    assert (latents[4.5] - latents[1.0]).abs().max() > 1e-2  # the guidance path ran


def test_sana_sprint_pipeline_with_a_guidance_embedding(parts, tmp_path):
    """SanaSprintPipeline (SCM scheduler, a guidance embedding scaled by guidance_embeds_scale) gives the same
    latents with either transformer."""
    theirs = diffusers_sana(seed=1, guidance_embeds=True, qk_norm="rms_norm_across_heads")
    theirs.save_pretrained(tmp_path / "sprint")
    ours = LinSanaTransformer2DModel.from_pretrained(tmp_path / "sprint")
    prompts = {k: v for k, v in _prompts().items() if not k.startswith("negative")}  # no negative prompt here
    latents = []
    for transformer in (theirs, ours):
        pipe = diffusers.SanaSprintPipeline(tokenizer=None, text_encoder=None, vae=parts[3], transformer=transformer,
                                            scheduler=diffusers.SCMScheduler())
        pipe.set_progress_bar_config(disable=True)
        latents.append(pipe(**prompts, num_inference_steps=2, guidance_scale=4.5, use_resolution_binning=False,
                            output_type="latent", generator=torch.Generator().manual_seed(0), **SIZE).images)
    assert latents[1].shape == (2, 4, 32, 16) and _max_err(latents[1], latents[0]) < 1e-5


def test_pipeline_folders_load_with_linvision_transformer(parts, tmp_path):
    """A saved pipeline (no tokenizer / text encoder: diffusers saves none and needs them passed as None) loads with
    linvision's transformer; saved again, model_index.json names linvision's class, the transformer folder is
    diffusers' (SanaTransformer2DModel loads it), and the pipeline reloads without passing the transformer."""
    theirs, _, _, vae = parts
    want = _run(_pipeline(theirs, vae))
    _pipeline(theirs, vae).save_pretrained(tmp_path / "pipe")
    pipe = diffusers.SanaPipeline.from_pretrained(
        tmp_path / "pipe", tokenizer=None, text_encoder=None,
        transformer=LinSanaTransformer2DModel.from_pretrained(tmp_path / "pipe", subfolder="transformer"))
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.transformer, LinSanaTransformer2DModel) and pipe.transformer.config.exact_eps
    assert _max_err(_run(pipe), want) < 1e-5

    pipe.save_pretrained(tmp_path / "again")
    index = json.loads((tmp_path / "again" / "model_index.json").read_text())
    assert index["transformer"] == ["linvision.diffusion.pipeline", "LinSanaTransformer2DModel"]
    back = diffusers.SanaTransformer2DModel.from_pretrained(tmp_path / "again" / "transformer")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in theirs.state_dict().items())
    again = diffusers.SanaPipeline.from_pretrained(tmp_path / "again", tokenizer=None, text_encoder=None)
    again.set_progress_bar_config(disable=True)
    assert type(again.transformer) is LinSanaTransformer2DModel
    assert _max_err(_run(again), want) < 1e-5
    half = diffusers.SanaPipeline.from_pretrained(tmp_path / "again", tokenizer=None, text_encoder=None,
                                                  dtype=torch.bfloat16)
    half.set_progress_bar_config(disable=True)
    assert half.transformer.dtype == torch.bfloat16 and half.transformer.device.type == "cpu"
    assert _max_err(_run(half), want) < 0.1


def test_checkpoint_route_gives_the_lindit_outputs(parts, tmp_path):
    """from_checkpoint(ema=True / False) gives the EMA / trained LinDiT's outputs bit for bit (linvision's own eps
    here: config exact_eps False), in the pipeline too; from_lindit shares the model."""
    _, folder, _, vae = parts
    model = load_diffusers_folder(str(folder))  # linvision's default eps
    ema = randomize(LinDiT(model.cfg), seed=5).eval()
    save_dit_checkpoint(str(tmp_path / "run"), model, ema, meta={"step": 0})
    x, context = torch.randn(2, 4, 8, 12), torch.randn(2, 5, 12)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1] * 5])
    for weights, flag in ((ema, True), (model, False)):
        wrapper = LinSanaTransformer2DModel.from_checkpoint(str(tmp_path / "run"), ema=flag)
        assert not wrapper.config.exact_eps and not wrapper.training
        with torch.no_grad():
            got = wrapper(x, context, torch.tensor([900.0, 250.0]), encoder_attention_mask=mask).sample
            want = weights(x, torch.tensor([0.9, 0.25]), context=context, context_mask=mask.bool())
        assert torch.equal(got, want)
    shared = LinSanaTransformer2DModel.from_lindit(ema)
    assert shared.dit is ema
    loaded = LinSanaTransformer2DModel.from_checkpoint(str(tmp_path / "run"))
    assert torch.equal(_run(_pipeline(loaded, vae)), _run(_pipeline(shared, vae)))


def test_save_pretrained_round_trip_through_diffusers(tmp_path):
    """save_pretrained writes diffusers' folder (single file or shards), pipeline keys included; diffusers loads
    the same weights and config and computes the same output, guidance embedding and qk norm included."""
    theirs = diffusers_sana(qk_norm="rms_norm_across_heads", guidance_embeds=True, timestep_scale=2.0,
                              guidance_embeds_scale=0.5)
    theirs.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    ours = LinSanaTransformer2DModel.from_pretrained(str(tmp_path / "src"))  # sharded
    public = [k for k in theirs.config if not k.startswith("_")]
    assert {k: ours.config[k] for k in public} == {k: theirs.config[k] for k in public}
    for name, shard in (("single", None), ("shards", "30KB")):
        ours.save_pretrained(tmp_path / name, max_shard_size=shard)
        back = diffusers.SanaTransformer2DModel.from_pretrained(tmp_path / name).eval()
        assert {k: back.config[k] for k in public} == {k: theirs.config[k] for k in public}
        assert all(torch.equal(back.state_dict()[k], v) for k, v in theirs.state_dict().items())
    assert len([f for f in os.listdir(tmp_path / "shards") if f.endswith(".safetensors")]) > 1
    x, context, g = torch.randn(2, 4, 8, 12), torch.randn(2, 5, 12), torch.tensor([4.5, 2.0]) * 0.5
    with torch.no_grad():
        want = back(x, context, torch.tensor([700.0, 30.0]), guidance=g, return_dict=False)[0]
        got = ours(x, context, torch.tensor([700.0, 30.0]), guidance=g, return_dict=False)[0]
    assert _max_err(got, want) < 1e-6
    fresh = LinSanaTransformer2DModel(**SANA_SMALL)  # diffusers-style construction from a config
    assert fresh.num_parameters() == diffusers.SanaTransformer2DModel(**SANA_SMALL).num_parameters()


def test_forward_takes_diffusers_masks_timesteps_and_dtypes(parts):
    """bool, integer, float and additive (B, 1, L) masks give one output; a scalar timestep is broadcast;
    .to(bfloat16) moves the model (.dtype follows) and its output stays close."""
    theirs, _, ours, _ = parts
    x, context = torch.randn(2, 4, 16, 8), torch.randn(2, 5, 12)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    additive = ((1 - keep.float()) * -10000.0)[:, None]  # diffusers' own conversion
    with torch.no_grad():
        want = theirs(x, context, torch.tensor([500.0, 500.0]), encoder_attention_mask=keep).sample
        outs = [ours(x, context, 500.0, encoder_attention_mask=m).sample
                for m in (keep, keep.bool(), keep.float(), additive)]
        assert all(torch.equal(o, outs[0]) for o in outs)
        assert _max_err(outs[0], want) < 1e-6
        assert ours.dtype == torch.float32 and ours.device.type == "cpu"
        half = LinSanaTransformer2DModel.from_pretrained(parts[1]).to(torch.bfloat16)
        assert half.dtype == torch.bfloat16 and half.dit.final_layer.linear.weight.dtype == torch.bfloat16
        low = half(x.bfloat16(), context.bfloat16(), 500.0, encoder_attention_mask=keep).sample
    assert low.dtype == torch.bfloat16 and _max_err(low, want) < 0.05


def test_errors_are_one_line(parts, tmp_path):
    _, folder, ours, _ = parts
    x, context = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 12)
    classes = create_dit("digits", depth=1)
    save_dit_checkpoint(str(tmp_path / "classes"), classes, classes, meta={"step": 0})
    cases = [
        (ValueError, "class-conditional", lambda: LinSanaTransformer2DModel.from_checkpoint(str(tmp_path / "classes"))),
        (FileNotFoundError, "no folder", lambda: LinSanaTransformer2DModel.from_pretrained(tmp_path / "absent")),
        (FileNotFoundError, "model.json", lambda: LinSanaTransformer2DModel.from_checkpoint(str(tmp_path / "no"))),
        (ValueError, r"encoder_attention_mask: expected shape \(1, 5\)",
         lambda: ours(x, context, 10.0, encoder_attention_mask=torch.ones(1, 4))),
        (ValueError, "encoder_attention_mask: values", lambda: ours(x, context, 10.0,
                                                                    encoder_attention_mask=torch.full((1, 5), 2))),
        (ValueError, r"timestep: expected a number or shape \(1,\)", lambda: ours(x, context, torch.ones(3))),
        (ValueError, "controlnet_block_samples", lambda: ours(x, context, 10.0, controlnet_block_samples=(x,))),
        (ValueError, "attention_kwargs", lambda: ours(x, context, 10.0, attention_kwargs={"scale": 0.5})),
        (ValueError, "guidance: required", lambda: ours(x, context, 10.0, guidance=3.0)),
        (ValueError, "variant", lambda: LinSanaTransformer2DModel.from_pretrained(folder, variant="fp16")),
        (ValueError, r"\['max_memory'\]", lambda: LinSanaTransformer2DModel.from_pretrained(folder,
                                                                                        max_memory={0: "1GB"})),
        (ValueError, "device_map", lambda: LinSanaTransformer2DModel.from_pretrained(folder, device_map="balanced")),
        (ValueError, "dtype", lambda: LinSanaTransformer2DModel.from_pretrained(folder, torch_dtype="half")),
        (ValueError, "safe_serialization", lambda: ours.save_pretrained(tmp_path / "o", safe_serialization=False)),
        (ValueError, "max_shard_size", lambda: ours.save_pretrained(tmp_path / "o", max_shard_size="lots")),
        (ValueError, "push_to_hub", lambda: ours.save_pretrained(tmp_path / "o", push_to_hub=True)),
        (TypeError, "expected a LinDiT", lambda: LinSanaTransformer2DModel.from_lindit(ours)),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "o").exists()


def test_package_imports_diffusers_only_on_demand():
    code = ("import sys, linvision.diffusion as d; assert 'diffusers' not in sys.modules; "
            "assert d.LinSanaTransformer2DModel.__module__ == 'linvision.diffusion.pipeline'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
