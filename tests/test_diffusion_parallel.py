"""Diffusion training beyond one process, on gloo: DDP and FSDP2 (fully_shard) under torchrun take the steps one
process takes with the whole batch; a sharded torch.distributed.checkpoint resumes at another world size and
loads for sampling and export; activation checkpointing changes no gradient."""
import os
import shutil

import pytest
import torch

from linvision.diffusion.checkpoint import is_sharded_checkpoint, load_dit
from linvision.diffusion.model import create_dit
from support import PY, ROOT, command_argv, run_subprocess, run_tool

MODEL = ["--model", "digits", "--model-kwargs", "depth=2", "dim=32", "num_heads=2", "head_dim=16",
         "num_cond_tokens=2"]
# warm-up longer than the run: the learning rate of step k is the same whatever --steps says, so a run that
# stops at step 2 and resumes to step 4 takes the steps of a 4-step run
RECIPE = ["--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "100", "--log-every", "1", "--save-every", "0",
          "--seed", "3", "--threads", "1"]


def _flags(out, experiment, steps, *extra):
    return [*MODEL, *RECIPE, "--output", str(out), "--experiment", experiment, "--steps", str(steps), *extra]


def _torchrun(*flags, ranks=2):
    proc = run_subprocess(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "--no-python",
         *command_argv("linvision-train-diffusion"), *flags],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _losses(stdout):
    return [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]


def _assert_same_weights(run_a, run_b, atol=2e-6):
    for ema in (False, True):
        a, _ = load_dit(str(run_a), ema=ema)
        b, _ = load_dit(str(run_b), ema=ema)
        for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
            torch.testing.assert_close(pb, pa, rtol=0, atol=atol, msg=f"{name} (ema={ema})")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, the whole batch of 8, 4 steps; and the same run's state at step 2."""
    out = tmp_path_factory.mktemp("one")
    four = run_tool("linvision-train-diffusion", *_flags(out, "four", 4))
    run_tool("linvision-train-diffusion", *_flags(out, "two", 2))
    return out, _losses(four.stdout)


def test_ddp_two_ranks_take_the_steps_of_one_process(one_process, tmp_path):
    """torchrun, 2 ranks x 4 images: the same losses (as logged, 4 decimals) and weights within 2e-6."""
    ref, losses = one_process
    proc = _torchrun(*_flags(tmp_path, "ddp", 4))
    assert _losses(proc.stdout) == losses and len(losses) == 4
    assert proc.stdout.count("done: step 4") == 1  # only rank 0 reports
    assert "2 rank(s) x 4 images per step, ddp" in proc.stdout
    _assert_same_weights(ref / "four", tmp_path / "ddp")
    assert not is_sharded_checkpoint(str(tmp_path / "ddp" / "last"))


def test_fsdp_shards_resume_on_two_ranks_and_on_one_process(one_process, tmp_path):
    """FSDP2 over 2 ranks (fp32 compute) to step 2: a sharded checkpoint (dcp/, no .safetensors) whose weights
    are the one-process run's at step 2; resumed by FSDP on 2 ranks and by a single process, both reach the
    one-process run's step-4 weights."""
    ref, losses = one_process
    first = _torchrun(*_flags(tmp_path, "fsdp", 2, "--parallel", "fsdp", "--fsdp-param-dtype", "fp32"))
    assert _losses(first.stdout) == losses[:2]
    last = tmp_path / "fsdp" / "last"
    assert is_sharded_checkpoint(str(last)) and not (last / "model.safetensors").exists()
    assert sorted(os.listdir(last)) == ["dcp", "model.json", "train_state.pt"]
    _assert_same_weights(ref / "two", tmp_path / "fsdp")  # load_dit reads the shards in one process
    shutil.copytree(tmp_path / "fsdp", tmp_path / "fsdp_to_one")
    again = _torchrun(*_flags(tmp_path, "fsdp", 4, "--parallel", "fsdp", "--fsdp-param-dtype", "fp32", "--resume"))
    assert "resumed from" in again.stdout and _losses(again.stdout) == losses[2:]
    _assert_same_weights(ref / "four", tmp_path / "fsdp")
    shutil.copytree(tmp_path / "fsdp_to_one", tmp_path / "fsdp_to_fsdp_one")
    one = run_tool("linvision-train-diffusion", *_flags(tmp_path, "fsdp_to_one", 4, "--resume"))
    assert _losses(one.stdout) == losses[2:]
    _assert_same_weights(ref / "four", tmp_path / "fsdp_to_one")
    assert not is_sharded_checkpoint(str(tmp_path / "fsdp_to_one" / "last"))  # a single process writes files
    # FSDP at another world size: the 2-rank shards resharded onto a group of one
    solo = run_tool("linvision-train-diffusion", *_flags(tmp_path, "fsdp_to_fsdp_one", 4, "--resume", "--parallel", "fsdp",
                                                   "--fsdp-param-dtype", "fp32"))
    assert _losses(solo.stdout) == losses[2:]
    _assert_same_weights(ref / "four", tmp_path / "fsdp_to_fsdp_one")


def test_a_single_process_checkpoint_resumes_as_fsdp_on_two_ranks(one_process, tmp_path):
    """The move after running out of memory: a plain run's checkpoint (weights files, optimizer state by
    parameter name) resumed by FSDP over 2 ranks reaches the uninterrupted run's step-4 weights."""
    ref, losses = one_process
    shutil.copytree(ref / "two", tmp_path / "grow")
    proc = _torchrun(*_flags(tmp_path, "grow", 4, "--parallel", "fsdp", "--fsdp-param-dtype", "fp32", "--resume"))
    assert _losses(proc.stdout) == losses[2:]
    _assert_same_weights(ref / "four", tmp_path / "grow")
    assert is_sharded_checkpoint(str(tmp_path / "grow" / "last"))


def test_two_ranks_split_the_latent_cache(tmp_path):
    """Under torchrun the ranks encode the missing shards between them: the cache holds what one process
    encodes, and the run trains on it."""
    from support import tiny_autoencoder

    from linvision.diffusion.data import ImageSet
    from linvision.diffusion.latent_cache import LatentCache
    from linvision.diffusion.latents import encode_images

    ae = tiny_autoencoder("AutoencoderKL", tmp_path / "ae")
    flags = ["--model", "digits", "--model-kwargs", "img_size=8", "in_chans=4", "dim=32", "depth=1", "num_heads=2",
             "head_dim=16", "num_cond_tokens=2", "--autoencoder", str(tmp_path / "ae"), "--cache-shard-size", "400",
             "--steps", "2", "--batch-size", "4", "--save-every", "0", "--threads", "1", "--output", str(tmp_path),
             "--experiment", "latent"]
    proc = _torchrun(*flags)
    assert proc.stdout.count("latent cache: shard") == 2  # 1437 images in 4 shards; rank 0 logs its 2 (0 and 2)
    cache = LatentCache(str(tmp_path / "latent" / "latents"))
    images = ImageSet("digits", 16, 1)
    idx = torch.tensor([0, 399, 400, 1436])
    torch.testing.assert_close(cache.latents(idx), encode_images(ae, images.images(idx).expand(-1, 3, -1, -1)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fsdp_bf16_with_activation_checkpointing_follows_fp32(one_process, tmp_path):
    """The default FSDP mode (bf16 compute, fp32 shards and reduction) with activation checkpointing: losses
    within 2% of the fp32 run's."""
    _, losses = one_process
    proc = _torchrun(*_flags(tmp_path, "bf16", 4, "--parallel", "fsdp", "--grad-checkpointing"))
    assert _losses(proc.stdout) == pytest.approx(losses, rel=2e-2)


def test_fsdp_in_one_process_and_bad_settings(one_process, tmp_path):
    """--parallel fsdp without torchrun shards over a group of one (same steps); a batch that does not split
    over the ranks and unknown modes fail in one line."""
    ref, losses = one_process
    proc = run_tool("linvision-train-diffusion", *_flags(tmp_path, "solo", 4, "--parallel", "fsdp",
                                                   "--fsdp-param-dtype", "fp32"))
    assert _losses(proc.stdout) == losses
    _assert_same_weights(ref / "four", tmp_path / "solo")
    bad = run_tool("linvision-train-diffusion", *_flags(tmp_path, "bad", 1, "--parallel", "zero3"), check=False)
    assert bad.returncode == 2 and "parallel" in bad.stderr.strip().splitlines()[-1]
    bad = run_tool("linvision-train-diffusion", *_flags(tmp_path, "bad", 1, "--fsdp-param-dtype", "fp8"), check=False)
    assert bad.returncode == 2 and "fsdp_param_dtype" in bad.stderr
    odd = run_subprocess(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python",
         *command_argv("linvision-train-diffusion"), *_flags(tmp_path, "odd", 1), "--batch-size", "7"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert odd.returncode != 0 and "do not split over 2 ranks" in odd.stderr


def test_activation_checkpointing_changes_no_gradient():
    torch.manual_seed(0)
    model = create_dit("digits", depth=2, dim=32, num_heads=2, head_dim=16).double()
    x, t, y = torch.randn(3, 1, 8, 8, dtype=torch.float64), torch.rand(3, dtype=torch.float64), torch.tensor([0, 4, 9])
    with torch.no_grad():  # the zero-initialised projections would hide the blocks' gradients
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    grads = []
    for enable in (False, True):
        model.zero_grad()
        model.set_grad_checkpointing(enable)
        model(x, t, y).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-12, atol=1e-12, msg=name)


def test_memory_benchmark_shows_fsdp_sharding_the_state(tmp_path):
    """linvision-bench-diffusion-parallel: on 2 ranks FSDP holds about half of DDP's weights, gradients and
    optimizer states per rank; the table and the JSON are written."""
    import json

    proc = run_subprocess(
        [*command_argv("linvision-bench-diffusion-parallel"), "--model", "digits", "--depth", "2",
         "--latent", "8", "--batch", "2", "--steps", "2", "--ranks", "2", "--modes", "ddp", "fsdp",
         "--param-dtype", "fp32", "--out", str(tmp_path / "mem")],
        cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = {p["mode"]: p for p in json.loads((tmp_path / "mem.json").read_text())["points"]}
    ddp, fsdp = points["ddp"], points["fsdp"]
    assert "error" not in ddp and "error" not in fsdp, (ddp.get("error"), fsdp.get("error"))
    for key in ("weights_mib", "ema_mib", "grads_mib", "optimizer_mib"):
        assert 0.45 * ddp[key] < fsdp[key] < 0.55 * ddp[key], key
    assert ddp["optimizer_mib"] == pytest.approx(2 * ddp["weights_mib"])  # AdamW: two moments per weight
    assert "| fsdp | 2 |" in (tmp_path / "mem.md").read_text()
