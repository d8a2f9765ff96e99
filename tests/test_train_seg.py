"""linvision-train-seg: semantic segmentation on the engine's trainer. Training on the offline mosaics lowers the
loss and writes the run folder; the reported mIoU, pixel accuracy and loss are those of the saved best/ model's
predictions on the validation set, computed here from an explicit confusion matrix in float64; a resumed run
repeats the uninterrupted run's losses bit for bit; --pretrained starts from exactly the encoder tensors of the
published file (timm's cache, with only the download replaced by a file copy); bad input is one line.

The models are tiny (one block per stage, small heads) and the images 64 px crops of 128 px mosaics."""
import argparse
import dataclasses
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from safetensors.torch import load_file

pytest.importorskip("segmentation_models_pytorch")

from linvision.data.mosaic import MEAN, MosaicSegmentation, SegmentationFolder, write_mosaic_folders  # noqa: E402
from linvision.training.seg_config import SegTrainConfig, add_seg_train_args  # noqa: E402
from linvision.data.segmentation import JointTransform, PadCollate  # noqa: E402
from linvision.training.seg_task import train_segmentation  # noqa: E402
from linvision.training.segmenter import load_segmenter  # noqa: E402
from linvision.training.train import train  # noqa: E402
from linvision.training.train_config import TrainConfig  # noqa: E402
from support import PY, ROOT, run_subprocess, run_tool, step_losses  # noqa: E402

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread, as the torchrun test's ranks have: the models are tiny, and on busy cores a second
    thread waiting for its share costs far more than it gives."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = ["--encoder", "linhier_delta_femto_224", "--model-kwargs", "depths=[1,1,1,1]",
        "--decoder-kwargs", "decoder_channels=[32,16,16,8,8]"]


def seg_flags(out, *extra):
    """A tiny Unet on 64 px crops of 8 training and 4 validation mosaics of 128 px, 2 steps an epoch."""
    return ["--dataset", "mosaic", "--mosaic-size", "128", "--mosaic-train", "8", "--mosaic-val", "4",
            "--img-size", "64", *TINY, "-b", "4", "--lr", "1e-3", "--log-interval", "1", "--output", str(out),
            "--no-progress", "--device", "cpu", *extra]


def epochs(run_dir, timed=True):
    """The epoch records of a run (without their times unless ``timed``)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "epoch"]
    return records if timed else [{k: v for k, v in r.items() if k != "time_s"} for r in records]


def test_flags_are_the_fields_of_seg_train_config():
    """One builder: every field of SegTrainConfig is a flag (and no other), the parsed defaults are the dataclass's,
    and the fields it shares with TrainConfig keep their spellings (-b, -j) and help."""
    parser = add_seg_train_args(argparse.ArgumentParser())
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests == {f.name for f in dataclasses.fields(SegTrainConfig)}
    assert vars(parser.parse_args([])) == SegTrainConfig().to_dict()
    args = parser.parse_args(["-b", "3", "-j", "2", "--decoder", "dpt", "--amp"])
    assert (args.batch_size, args.workers, args.decoder, args.amp) == (3, 2, "dpt", "bf16")
    ours = {f.name: f for f in dataclasses.fields(SegTrainConfig)}
    theirs = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in ("workers", "opt", "sched", "model_ema", "clip_grad", "amp", "stop_after_steps", "seed"):
        assert ours[name].metadata == theirs[name].metadata, name
    with pytest.raises(SystemExit):
        parser.parse_args(["--decoder", "deeplabv3"])
    with pytest.raises(ValueError, match="img_size: must be a multiple of 32 for unet, got 100"):
        SegTrainConfig(img_size=100).check()
    with pytest.raises(ValueError, match="ignore_index: must not be a class index"):
        SegTrainConfig(num_classes=12, ignore_index=5).check()
    with pytest.raises(TypeError, match="a SegTrainConfig needs the task it is the recipe of"):
        train(SegTrainConfig(dataset="mosaic"))


def test_the_decoder_flag_takes_the_segmenters_one_table_without_importing_smp():
    """--decoder's choices are segmenter.DECODERS (the benchmark's too), each with a stride; parsing the flags
    and checking the names imports no smp (a fresh process)."""
    from linvision.benchmark import throughput as benchmark
    from linvision.training.segmenter import DECODERS, STRIDE

    assert list(DECODERS) == ["unet", "fpn", "segformer", "upernet", "dpt"] and set(STRIDE) == set(DECODERS)
    assert benchmark.DECODERS is DECODERS
    choices = next(a.choices for a in add_seg_train_args(argparse.ArgumentParser())._actions if a.dest == "decoder")
    assert choices == list(DECODERS)
    code = ("import argparse, sys\n"
            "from linvision.training.seg_config import add_seg_train_args\n"
            "args = add_seg_train_args(argparse.ArgumentParser()).parse_args(['--decoder', 'fpn'])\n"
            "print(args.decoder, 'segmentation_models_pytorch' in sys.modules)")
    proc = run_subprocess([PY, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["fpn", "False"]


def test_joint_transform_moves_image_and_mask_alike_and_padding_is_ignored():
    """A flipped, resized crop of an image whose left half is dark and right half bright moves the mask's halves
    with it (nearest neighbour: no value between the classes); validation batches of several sizes are padded
    with zeros and the ignore index."""
    pixels = np.zeros((64, 96, 3), np.uint8)
    pixels[:, 48:] = 200
    mask = np.zeros((64, 96), np.uint8)
    mask[:, 48:] = 3
    torch.manual_seed(0)
    x, m = JointTransform((0, 0, 0), (1, 1, 1), crop=32, scale=(1, 1), ratio=(1.5, 1.5), hflip=1.0)(
        Image.fromarray(pixels), Image.fromarray(mask))
    assert x.shape == (3, 32, 32) and m.shape == (32, 32) and m.dtype == torch.int64
    assert set(m.unique().tolist()) == {0, 3}
    assert (m[:, :16] == 3).all() and (m[:, 16:] == 0).all()  # flipped: the class 3 half is on the left now
    assert (x[:, :, :15] > 0.7).all() and (x[:, :, 17:] < 0.1).all()  # and the bright half with it
    batch = PadCollate(255, 32)([(torch.ones(3, 64, 40), torch.zeros(64, 40, dtype=torch.int64)),
                                 (torch.ones(3, 30, 64), torch.ones(30, 64, dtype=torch.int64))])
    images, masks = batch
    assert images.shape == (2, 3, 64, 64) and masks.shape == (2, 64, 64)
    assert images[0, :, :, 40:].abs().sum() == 0 and (masks[0, :, 40:] == 255).all() and (masks[0, :, :40] == 0).all()
    assert (masks[1, 30:] == 255).all() and (masks[1, :30] == 1).all()


def test_training_on_mosaics_lowers_the_loss_and_writes_the_run_folder(tmp_path):
    out = run_tool("train_seg.py", *seg_flags(tmp_path, "--epochs", "3", "--experiment", "mosaics")).stdout
    run = tmp_path / "mosaics"
    records = epochs(run)
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert records[-1]["train_loss"] < 0.95 * records[0]["train_loss"]
    # six steps move 4 validation mosaics' loss by a few percent (2.7% at this seed): lower, not by a margin
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    for r in records:
        assert 0 <= r["val_miou"] <= 100 and 0 <= r["val_pixel_acc"] <= 100
    assert [s for s, _ in step_losses(run)] == list(range(1, 7))
    summary = json.loads((run / "summary.json").read_text())
    best = max(records, key=lambda r: r["val_miou"])
    assert summary["best_miou"] == best["val_miou"] and summary["best_epoch"] == best["epoch"]
    assert summary["best"]["pixel_acc"] == best["val_pixel_acc"] and summary["num_classes"] == 10
    assert (summary["encoder"], summary["decoder"]) == ("linhier_delta_femto_224", "unet")
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["decoder"] == "unet" and config["dataset"] == "mosaic" and "resume" not in config
    for folder in ("last", "best"):
        assert (run / folder / "model.safetensors").is_file()
        assert not (run / folder / "config.json").exists()  # an smp model is no timm model: no timm hub config
        meta = json.loads((run / folder / "model.json").read_text())
        assert (meta["encoder"], meta["decoder"], meta["num_classes"], meta["img_size"]) == \
            ("linhier_delta_femto_224", "unet", 10, 64)
        assert (meta["mosaic_size"], meta["mosaic_val"]) == (128, 4)
        assert meta["classes"] == list(MosaicSegmentation.classes) and meta["mean"] == list(MEAN)
    assert (run / "last" / "train_state.pt").is_file() and not (run / "best" / "train_state.pt").exists()
    assert f"best mIoU {summary['best_miou']:.2f} at epoch {summary['best_epoch']}" in out
    # linvision-validate on the run: by default the 4 validation mosaics at 128 px, which best/ scored on
    scored = json.loads(run_tool("validate.py", "--checkpoint", str(run), "--device", "cpu").stdout)
    assert scored["task"] == "segmentation" and scored["model"] == "unet on linhier_delta_femto_224"
    (at_128,) = scored["results"]
    assert at_128["img_size"] == 128 and at_128["miou"] == pytest.approx(summary["best_miou"], rel=1e-12)
    assert at_128["pixel_acc"] == pytest.approx(summary["best"]["pixel_acc"], rel=1e-12)


def test_reported_scores_are_those_of_the_best_models_predictions(tmp_path):
    """Image/mask folders with unlabelled (255) bands: mIoU, pixel accuracy, per-class IoU and loss of best/ (here
    the EMA's or the model's weights, whichever scored higher) as reported equal those computed here from the
    saved model's predictions, the validation images read as the trainer reads them."""
    root = _with_unlabelled_bands(write_mosaic_folders(str(tmp_path / "data"), size=128, train=8, val=4, seed=0))
    flags = seg_flags(tmp_path, "--epochs", "2", "--experiment", "folder", "--model-ema", "--model-ema-decay", "0.5",
                      "--dataset", "folder", "--data-dir", root)
    run_tool("train_seg.py", *flags)
    summary = json.loads((tmp_path / "folder" / "summary.json").read_text())
    model, meta = load_segmenter(str(tmp_path / "folder"))
    assert meta["weights"] == summary["best"]["weights"] and meta["epoch"] == summary["best_epoch"]
    miou, pixel_acc, iou, loss = _direct_scores(model, meta, root, [[0, 1, 2, 3]])
    best = summary["best"]
    assert best["miou"] == pytest.approx(miou, rel=1e-12)
    assert best["pixel_acc"] == pytest.approx(pixel_acc, rel=1e-12)
    assert best["loss"] == pytest.approx(loss, rel=1e-5)
    assert meta["iou"] == [None if v is None else pytest.approx(v, rel=1e-12) for v in iou]  # percent, as mIoU
    assert meta["miou"] == pytest.approx(np.mean([v for v in meta["iou"] if v is not None]), rel=1e-12)
    assert meta["pixels"] == 4 * (128 - 16) * 128  # the bands are not counted


def test_validate_scores_a_segmenter_at_other_sizes(tmp_path):
    """linvision-validate on a folder-trained segmenter: as the images are (and at their own shorter side, 128 px)
    it reports what best/ scored; at 96 and 160 px each image and its mask are resized alike (the mask by nearest
    neighbour: its values stay class indices and 255) and the figures are those computed here from the resized
    pairs; a dataset a segmenter cannot be scored on is one line."""
    root = _with_unlabelled_bands(write_mosaic_folders(str(tmp_path / "data"), size=128, train=8, val=4, seed=0))
    run_tool("train_seg.py", *seg_flags(tmp_path, "--epochs", "1", "--experiment", "folder", "--dataset", "folder",
                                        "--data-dir", root))
    run = str(tmp_path / "folder")
    out = tmp_path / "scores.json"
    run_tool("validate.py", "--checkpoint", run, "--img-size", "128", "96", "160", "-b", "2", "--output", str(out))
    scored = json.loads(out.read_text())
    summary = json.loads((tmp_path / "folder" / "summary.json").read_text())
    model, meta = load_segmenter(run)
    assert meta["data_dir"] == root and scored["dataset"] == "folder"
    native = json.loads(run_tool("validate.py", "--checkpoint", run).stdout)["results"][0]
    assert native["img_size"] is None and native["miou"] == pytest.approx(summary["best"]["miou"], rel=1e-12)
    for entry, size in zip(scored["results"], (128, 96, 160)):
        miou, pixel_acc, iou, loss = _direct_scores(model, meta, root, [[0, 1], [2, 3]], resize=size)
        assert entry["img_size"] == size
        assert entry["miou"] == pytest.approx(miou, rel=1e-12)
        assert entry["pixel_acc"] == pytest.approx(pixel_acc, rel=1e-12)
        assert entry["loss"] == pytest.approx(loss, rel=1e-5)
        assert entry["iou"] == [None if v is None else pytest.approx(v, rel=1e-12) for v in iou]  # percent
        if size == 128:  # the images' own size: the bands of 16 rows are not counted
            assert entry["pixels"] == 4 * (128 - 16) * 128
    assert scored["results"][0]["miou"] == pytest.approx(native["miou"], rel=1e-12)
    val = SegmentationFolder(root, "val", transform=JointTransform(meta["mean"], meta["std"], resize=96))
    image, mask = val[0]
    assert image.shape == (3, 96, 96) and set(mask.unique().tolist()) <= set(range(10)) | {255}
    bad = run_tool("validate.py", "--checkpoint", run, "--dataset", "digits", check=False)
    assert bad.returncode != 0 and "dataset: a segmenter is scored on 'folder' or 'mosaic' data" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def _with_unlabelled_bands(root):
    """Set rows 40-55 of every mask of the folder set ``root`` to the ignore index."""
    for split in ("train", "val"):
        for name in sorted(os.listdir(os.path.join(root, split, "masks"))):
            path = os.path.join(root, split, "masks", name)
            mask = np.array(Image.open(path))
            mask[40:56] = 255
            Image.fromarray(mask).save(path)
    return root


def _direct_scores(model, meta, root, batches, resize=None):
    """mIoU, pixel accuracy and per-class IoU (percent) and mean loss of ``model`` on the validation images of
    ``root`` (resized to the shorter side ``resize``) run in ``batches`` (lists of indices): an explicit confusion
    matrix in float64, classes without pixels in masks or predictions left out."""
    val = SegmentationFolder(root, "val", transform=JointTransform(meta["mean"], meta["std"], resize=resize))
    confusion, loss_sum = np.zeros((10, 10)), 0.0
    for batch in batches:
        images = torch.stack([val[i][0] for i in batch])
        masks = torch.stack([val[i][1] for i in batch])
        with torch.no_grad():
            logits = model(images)
        labelled = masks != 255
        truth, pred = masks[labelled].numpy(), logits.argmax(1)[labelled].numpy()
        confusion += np.bincount(truth * 10 + pred, minlength=100).reshape(10, 10)
        loss_sum += F.cross_entropy(logits, masks, ignore_index=255, reduction="sum").item()
    hits = np.diag(confusion)
    union = confusion.sum(0) + confusion.sum(1) - hits
    return (100 * np.mean(hits[union > 0] / union[union > 0]), 100 * hits.sum() / confusion.sum(),
            [None if u == 0 else 100 * h / u for h, u in zip(hits, union)], loss_sum / confusion.sum())


def test_two_processes_score_the_whole_validation_set(tmp_path):
    """Under torchrun (2 ranks, gloo) each rank scores its share of 5 validation images (3 and 2); the reported
    figures are those of all 5, computed here from best/ in the same batches, with one thread as each rank."""
    root = _with_unlabelled_bands(write_mosaic_folders(str(tmp_path / "data"), size=128, train=8, val=5, seed=0))
    flags = seg_flags(tmp_path, "--epochs", "1", "--experiment", "ddp", "--dataset", "folder", "--data-dir", root,
                      "-b", "2")
    proc = run_subprocess([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(ROOT, "linvision", "tools", "train_seg.py"), *flags],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("best mIoU") == 1  # only rank 0 reports
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    model, meta = load_segmenter(str(tmp_path / "ddp"))
    miou, pixel_acc, _, loss = _direct_scores(model, meta, root, [[0, 2], [4], [1, 3]])
    shard_miou, _, _, _ = _direct_scores(model, meta, root, [[0, 2], [4]])
    assert summary["best"]["miou"] == pytest.approx(miou, rel=1e-12)
    assert summary["best"]["pixel_acc"] == pytest.approx(pixel_acc, rel=1e-12)
    assert summary["best"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert abs(shard_miou - miou) > 1e-3  # rank 0's share alone would have scored otherwise


def test_resume_equals_uninterrupted_training(tmp_path):
    """2 epochs of 2 steps with an EMA; the interrupted run stops mid-epoch 1 (step 3) and is resumed: the same
    losses, scores and weights, bit for bit."""
    base = SegTrainConfig.from_namespace(add_seg_train_args(argparse.ArgumentParser()).parse_args(
        seg_flags(tmp_path, "--epochs", "2", "--model-ema", "--model-ema-decay", "0.9", "--warmup-epochs", "1",
                  "--drop-path", "0.1")))
    ref = train_segmentation(base.replace(experiment="ref"))
    part = train_segmentation(base.replace(experiment="cut", stop_after_steps=3))
    assert part["stopped_at_step"] == 3
    resumed = train_segmentation(base.replace(experiment=None, resume=part["run_dir"]))
    assert resumed["run_dir"] == part["run_dir"]
    ref_losses = step_losses(ref["run_dir"])
    assert [s for s, _ in ref_losses] == [1, 2, 3, 4]
    assert step_losses(resumed["run_dir"]) == ref_losses
    assert epochs(resumed["run_dir"], timed=False) == epochs(ref["run_dir"], timed=False)
    assert resumed["best"] == ref["best"]
    a = load_file(os.path.join(ref["run_dir"], "last", "model.safetensors"))
    b = load_file(os.path.join(resumed["run_dir"], "last", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pretrained_encoder_starts_from_the_published_file(tmp_path, monkeypatch):
    """--encoder mlla_tiny.in1k --pretrained: the authors' file comes through timm's cache (the transfer replaced by
    a copy) and the encoder starts from exactly its tensors (a learning rate of 1e-12 keeps them over one step);
    --pretrained-path with the same file gives the same encoder."""
    import timm

    from support import authors_layout, serve_downloads_from
    from support import RESOLUTION_BUFFERS, save_published

    state = authors_layout("mlla_tiny", blocks=1)
    path = tmp_path / "mlla_t.pth"
    save_published(path, state)
    asked = serve_downloads_from(monkeypatch, tmp_path, path)
    reference = timm.create_model("mlla_tiny", depths=(1, 1, 1, 1), pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(path))).state_dict()
    flags = seg_flags(tmp_path, "--epochs", "1", "--stop-after-steps", "1", "--lr", "1e-12", "--warmup-lr",
                      "1e-12", "--min-lr", "1e-12", "--weight-decay", "0")
    flags[flags.index("linhier_delta_femto_224")] = "mlla_tiny.in1k"
    out = run_tool("train_seg.py", *flags, "--pretrained", "--experiment", "hub").stdout
    assert asked == ["https://cloud.tsinghua.edu.cn/f/7a19712877cb4242889c/?dl=1"]
    assert "pretrained: encoder mlla_tiny.in1k from" in out and "a new unet head for 10 classes" in out
    flags[flags.index("mlla_tiny.in1k")] = "mlla_tiny"
    run_tool("train_seg.py", *flags, "--pretrained-path", str(path), "--experiment", "file")
    assert len(asked) == 1

    for run in ("hub", "file"):
        tuned = load_file(str(tmp_path / run / "last" / "model.safetensors"))
        compared = 0
        for key, value in reference.items():
            if key.startswith(("head.", "final.")) or not value.is_floating_point() \
                    or key.endswith(("running_mean", "running_var", *RESOLUTION_BUFFERS)):
                continue
            torch.testing.assert_close(tuned["encoder.model.model." + key], value, rtol=0, atol=1e-7, msg=key)
            compared += 1
        assert compared > 50, compared


@pytest.mark.parametrize("decoder, encoder, extra", [
    ("fpn", "linhier_delta_femto_224", ["--decoder-kwargs", "decoder_pyramid_channels=32",
                                        "decoder_segmentation_channels=32"]),  # GroupNorm(32)
    ("segformer", "linhier_delta_femto_224", ["--decoder-kwargs", "decoder_segmentation_channels=16"]),
    ("upernet", "linhier_delta_femto_224", ["--decoder-kwargs", "decoder_channels=16"]),
    ("dpt", "linvit_tiny_patch16_224", ["--model-kwargs", "embed_dim=48", "num_heads=2", "--decoder-kwargs",
                                        "decoder_intermediate_channels=[16,16,16,16]", "decoder_fusion_channels=16"]),
])
def test_every_head_trains_and_its_checkpoint_rebuilds(decoder, encoder, extra, tmp_path):
    """FPN, Segformer and UPerNet on linhier, DPT on a linvit with a fixed-size position embedding (trained on 64 px
    crops, validated on 128 px mosaics): one epoch, and load_segmenter rebuilds last/ to the saved weights, which
    run at another size."""
    flags = seg_flags(tmp_path, "--epochs", "1", "--mosaic-train", "4", "--experiment", decoder, "--decoder", decoder)
    flags[flags.index("linhier_delta_femto_224")] = encoder
    summary = train_segmentation(add_seg_train_args(argparse.ArgumentParser()).parse_args(flags + extra))
    assert summary["decoder"] == decoder and summary["best_epoch"] == 0 and summary["best"]["miou"] > 0
    model, meta = load_segmenter(os.path.join(summary["run_dir"], "last"))
    saved = load_file(os.path.join(summary["run_dir"], "last", "model.safetensors"))
    assert meta["decoder"] == decoder and all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert model(torch.randn(1, 3, 96, 160)).shape == (1, 10, 96, 160)


def _bad_mask_folder(tmp_path):
    root = write_mosaic_folders(str(tmp_path / "bad"), size=128, train=4, val=2, seed=0)
    path = os.path.join(root, "train", "masks", "00002.png")
    mask = np.array(Image.open(path))
    mask[:3, :5] = 12
    Image.fromarray(mask).save(path)
    return root, path


@pytest.mark.parametrize("case", ["missing_data", "bad_mask", "no_weights", "no_smp"])
def test_bad_input_is_one_line(case, tmp_path, monkeypatch):
    flags = seg_flags(tmp_path, "--epochs", "1", "--experiment", "bad")
    if case == "missing_data":
        flags += ["--dataset", "folder", "--data-dir", str(tmp_path / "nowhere")]
        expected = f"error: data_dir: folder not found: {tmp_path / 'nowhere'}"
    elif case == "bad_mask":
        root, path = _bad_mask_folder(tmp_path)
        flags += ["--dataset", "folder", "--data-dir", root]
        expected = (f"error: mask: {path} holds the value 12 (15 pixels), neither a class index (0 to 9 for "
                    f"num_classes 10) nor the ignore index 255")
    elif case == "no_weights":
        flags += ["--pretrained"]
        expected = "error: pretrained: linhier_delta_femto_224 has no trained weights"
    else:
        monkeypatch.setitem(__import__("sys").modules, "segmentation_models_pytorch", None)
        expected = 'error: segmentation needs segmentation_models_pytorch, which is not installed: ' \
                   'pip install "linvision[seg]"'
    proc = run_tool("train_seg.py", *flags, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(expected) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    if case != "bad_mask":  # refused before a run folder is made
        assert not (tmp_path / "bad").exists()


def test_a_segmenter_saved_with_the_encoder_s_unused_final_layer_still_loads(tmp_path):
    """Segmenters on MLLA and RAVLT saved before the features-only encoder dropped its unused final layer (MLLA's
    final norm, RAVLT's final conv) load, and give the outputs of the weights they hold."""
    import json

    from safetensors.torch import save_file

    from linvision.training.segmenter import build_segmenter, load_segmenter

    for encoder, extra in (("mlla_tiny", {"encoder.model.model.final.weight": torch.ones(512)}),
                           ("ravlt_tiny", {"encoder.model.model.final.conv.weight": torch.ones(8, 512, 1, 1)})):
        torch.manual_seed(0)
        model = build_segmenter("unet", encoder, 3, {"depths": [1, 1, 1, 1]}, None).eval()
        folder = tmp_path / encoder
        folder.mkdir()
        save_file({**{k: v.contiguous() for k, v in model.state_dict().items()}, **extra},
                  str(folder / "model.safetensors"))
        (folder / "model.json").write_text(json.dumps({
            "task": "segmentation", "encoder": encoder, "decoder": "unet", "num_classes": 3,
            "model_kwargs": {"depths": [1, 1, 1, 1]}, "decoder_kwargs": {}, "classes": ["a", "b", "c"],
            "mean": [0.5] * 3, "std": [0.5] * 3, "ignore_index": 255, "img_size": 64, "in_chans": 3}))
        loaded, _ = load_segmenter(str(folder))
        x = torch.randn(1, 3, 64, 64)
        with torch.no_grad():
            assert torch.equal(loaded(x), model(x))


def test_model_json_has_one_reader(tmp_path):
    """load_segmenter, checkpoint_task and load_model read model.json through read_checkpoint_meta: the same
    one-line errors (not JSON; not an object with the keys the reader needs, naming them), the task it names."""
    from linvision.utils.checkpoint import checkpoint_task, load_model

    meta = tmp_path / "model.json"
    meta.write_text("{not json")
    for read in (load_segmenter, checkpoint_task, load_model):
        with pytest.raises(ValueError, match=f"^checkpoint: {meta} is not valid JSON"):
            read(str(tmp_path))
    meta.write_text(json.dumps({"model": "linhier_delta_femto_224", "num_classes": 3}))
    assert checkpoint_task(str(tmp_path)) == "classification"
    with pytest.raises(ValueError, match=r"lacks \['encoder', 'decoder', 'num_classes'\] \(has \['model', "
                                         r"'num_classes'\]\); it describes no segmenter"):
        load_segmenter(str(tmp_path))
    meta.write_text(json.dumps({"task": "segmentation", "encoder": "linhier_delta_femto_224", "decoder": "fpn",
                                "num_classes": 3}))
    assert checkpoint_task(str(tmp_path)) == "segmentation"
    with pytest.raises(ValueError, match=r"lacks \['model', 'num_classes'\]"):
        load_model(str(tmp_path))
    meta.write_text("[1, 2]")
    for read in (load_segmenter, checkpoint_task, load_model):
        with pytest.raises(ValueError, match=r"lacks .* \(has list\)"):
            read(str(tmp_path))
