"""Published weights without a network: a failed download is one line that names the model, the address and the
way to load a copy fetched elsewhere, and a local file given on the command line wins over a recipe's
``pretrained: true``. Every download is replaced by a failure (timm's transfer function, or the hub's), so
nothing here reaches the network."""
import json
import os
import re
import socket
import urllib.error

import pytest
import timm
import torch
import yaml
from safetensors.torch import load_file

import linvision.models  # noqa: F401  (registers the models with timm)
from linvision.models.published import WeightsDownloadError
from support import ROOT, run_tool, write_image_folder

ONE_BLOCK = dict(depths=(1, 1, 1, 1))
MLLA_URL = "https://cloud.tsinghua.edu.cn/f/7a19712877cb4242889c/?dl=1"


def _offline(monkeypatch, tmp_path):
    """timm's cache in ``tmp_path`` and its download failing as it does without a network (an unknown host);
    returns the list of urls asked for."""
    import timm.models._hub as hub

    asked = []

    def unreachable(url, dst, hash_prefix=None, progress=True):
        asked.append(url)
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(hub, "download_url_to_file", unreachable)
    return asked


def _weights(model):
    return {k: v for k, v in model.state_dict().items() if v.is_floating_point()}


def _same_weights(a, b, skip=("running_mean", "running_var")):
    """Every floating tensor of ``b`` but the skipped ones equals ``a``'s; the number compared."""
    compared = 0
    for key, value in b.items():
        if key.endswith(skip) or not value.is_floating_point():
            continue
        torch.testing.assert_close(a[key], value, rtol=0, atol=1e-6, msg=key)
        compared += 1
    return compared


@pytest.mark.parametrize("name", ["mlla_tiny", "ravlt_tiny"])
def test_failed_download_is_one_line_and_its_advice_works(name, tmp_path, monkeypatch):
    """timm.create_model(name, pretrained=True) offline: WeightsDownloadError (a FileNotFoundError) in one line
    with the model and tag, the url, the network's answer and the offline way; the cache path it names is where
    timm then finds a file placed by hand, and the overlay it names loads the same file."""
    asked = _offline(monkeypatch, tmp_path)
    url = timm.models.get_pretrained_cfg(f"{name}.in1k").url
    url = url[0] if isinstance(url, (tuple, list)) else url
    with pytest.raises(WeightsDownloadError) as e:
        timm.create_model(name, pretrained=True, **ONE_BLOCK)
    message = str(e.value)
    assert isinstance(e.value, FileNotFoundError) and len(message.splitlines()) == 1
    assert message.startswith(f"pretrained: cannot download the weights of {name}.in1k from {url} "
                              "(gaierror: [Errno -2] Name or service not known); offline, download that file")
    assert "pretrained_cfg_overlay=dict(file=PATH) to timm.create_model" in message
    assert "--pretrained-path PATH to linvision-train / linvision-train-seg" in message
    assert message.endswith("the model cards in docs/models/published.md)")
    assert asked == [url]

    cached = re.search(r"put it at (\S+) \(timm's cache", message).group(1)
    assert cached.startswith(str(tmp_path / "torch_home" / "hub" / "checkpoints") + os.sep)
    trained = timm.create_model(name, num_classes=1000, **ONE_BLOCK)  # random weights stand for the file
    torch.save(trained.state_dict(), cached)
    placed = timm.create_model(name, pretrained=True, **ONE_BLOCK)
    assert asked == [url]  # found in the cache, no second download
    assert _same_weights(_weights(placed), _weights(trained), skip=()) > 20
    given = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=cached), **ONE_BLOCK)
    assert _same_weights(_weights(given), _weights(trained), skip=()) > 20


def test_the_manual_lists_every_published_file_where_the_message_points():
    """The offline section of docs/models/published.md (the page the message names) gives, for every MLLA and
    RAVLT weight tag, the address its pretrained cfg downloads from and the file name timm's cache uses."""
    from linvision.utils.factory import models_with_weights

    with open(os.path.join(ROOT, "docs", "models", "published.md")) as f:
        section = f.read().split("## Offline: the authors' file by hand", 1)[1].split("\n## ", 1)[0]
    published = [n for n in models_with_weights() if n.startswith(("mlla_", "ravlt_"))]
    assert len(published) == 7
    for name in published:
        url = timm.models.get_pretrained_cfg(name).url
        url, filename = url if isinstance(url, (tuple, list)) else (url, url.rsplit("/", 1)[1])
        assert f"| `{name}` | <{url}> | `{filename}` |" in section, name


def test_failed_hub_download_names_the_hub_repository(monkeypatch):
    """Weights on the Hugging Face hub (linvit's DeiT start): the hub's own offline error becomes the same one
    line, naming the repository and linvit's page."""
    import timm.models._builder as builder
    from huggingface_hub.errors import LocalEntryNotFoundError

    def no_hub(*args, **kwargs):
        raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub and we cannot "
                                      "find the requested files in the local cache.")

    monkeypatch.setattr(builder, "load_state_dict_from_hf", no_hub)
    with pytest.raises(WeightsDownloadError) as e:
        timm.create_model("linvit_tiny_patch16_224.deit_fb_in1k", pretrained=True, depth=1)
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("pretrained: cannot download the weights of linvit_tiny_patch16_224.deit_fb_in1k "
                              "from the Hugging Face hub (repository timm/deit_tiny_patch16_224.fb_in1k) "
                              "(LocalEntryNotFoundError: An error happened")
    assert "https://huggingface.co/timm/deit_tiny_patch16_224.fb_in1k" in message
    assert "pretrained_cfg_overlay=dict(file=PATH)" in message and "--pretrained-path PATH" in message
    assert message.endswith("the model cards in docs/models/linvit.md)")


def test_a_missing_local_file_is_not_called_a_download(tmp_path, monkeypatch):
    """A file named by the overlay that is not there is the file's error, not advice to download it; and a model
    built without pretrained weights never asks for a download."""
    asked = _offline(monkeypatch, tmp_path)
    missing = str(tmp_path / "missing.pth")
    with pytest.raises(FileNotFoundError) as e:
        timm.create_model("mlla_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=missing), **ONE_BLOCK)
    assert not isinstance(e.value, WeightsDownloadError) and missing in str(e.value)
    timm.create_model("mlla_tiny", **ONE_BLOCK)
    assert asked == []


def _tiny_recipe(data, out, *extra):
    """The shipped fine-tuning recipe (pretrained: true) at a tiny size: one block a stage, 32 px, batch 4."""
    return ["--config", "finetune_mlla_tiny", "--data-dir", data, "--img-size", "32", "--model-kwargs",
            '{"depths": [1, 1, 1, 1]}', "--batch-size", "4", "--epochs", "1", "--output", str(out), "--no-progress",
            "--device", "cpu", *extra]


def test_tools_say_the_failed_download_in_one_line(tmp_path, monkeypatch):
    """linvision-train with the shipped recipe, linvision-train-seg and linvision-validate offline: status 2 and
    one line on stderr naming the model, the url and --pretrained-path."""
    asked = _offline(monkeypatch, tmp_path)
    data = write_image_folder(tmp_path / "data", classes=3, size=32)
    runs = {
        "train.py": ["--config", "finetune_mlla_tiny", "--data-dir", data, "--output", str(tmp_path / "out"),
                     "--no-progress", "--device", "cpu"],
        "train_seg.py": ["--encoder", "mlla_tiny.in1k", "--pretrained", "--dataset", "mosaic", "--mosaic-size",
                         "128", "--mosaic-train", "4", "--mosaic-val", "2", "--img-size", "64", "--output",
                         str(tmp_path / "seg"), "--no-progress", "--device", "cpu"],
        "validate.py": ["--model", "mlla_tiny.in1k", "--pretrained", "--data-dir", data, "--device", "cpu"],
    }
    for tool, flags in runs.items():
        proc = run_tool(tool, *flags, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (tool, proc.stderr)
        assert proc.stderr.startswith(f"error: pretrained: cannot download the weights of mlla_tiny.in1k from "
                                      f"{MLLA_URL} ("), (tool, proc.stderr)
        assert "--pretrained-path PATH" in proc.stderr and "Traceback" not in proc.stderr
    assert asked == [MLLA_URL] * 3


def test_pretrained_path_on_the_command_line_wins_over_the_recipe(tmp_path, monkeypatch):
    """--config finetune_mlla_tiny (pretrained: true) --pretrained-path FILE: a note says the recipe's pretrained
    is off, nothing is downloaded, training starts from the file's weights (a learning rate of 1e-12 keeps
    them), config.yaml records the choice, the run resumes and validates."""
    asked = _offline(monkeypatch, tmp_path)
    data = write_image_folder(tmp_path / "data", classes=3, size=32)
    start = timm.create_model("mlla_tiny", num_classes=3, **ONE_BLOCK)
    path = str(tmp_path / "start.pth")
    torch.save(start.state_dict(), path)
    flags = _tiny_recipe(data, tmp_path, "--experiment", "local", "--lr", "1e-12", "--warmup-lr", "1e-12",
                         "--min-lr", "1e-12", "--weight-decay", "0", "--pretrained-path", path)
    out = run_tool("train.py", *flags, "--stop-after-steps", "1").stdout
    notes = [line for line in out.splitlines() if "replaces the config's pretrained: true" in line]
    assert notes == [f"pretrained: --pretrained-path {path} on the command line replaces the config's pretrained: "
                     "true (the model's own weights are not downloaded)"]
    assert "pretrained: loaded" in out and path in out and asked == []
    run = tmp_path / "local"
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["pretrained"] is False and recorded["pretrained_path"] == path
    tuned = load_file(str(run / "last" / "model.safetensors"))
    assert _same_weights(tuned, start.state_dict()) > 20  # every tensor, the head too (3 classes both)

    resumed = run_tool("train.py", "--resume", str(run), "--no-progress").stdout
    assert "resume:" in resumed and "replaces" not in resumed and asked == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 1 and summary["num_classes"] == 3
    result = json.loads(run_tool("validate.py", "--checkpoint", str(run), "--device", "cpu").stdout)["results"][0]
    assert result["img_size"] == 32 and result["count"] == 6 and 0 <= result["top1"] <= 100


def test_segmentation_pretrained_path_wins_over_the_recipe(tmp_path, monkeypatch):
    """linvision-train-seg with a recipe of encoder mlla_tiny.in1k and pretrained: true, and --pretrained-path FILE
    typed: the note, no download, the encoder starts from the file (a learning rate of 1e-12 keeps it)."""
    asked = _offline(monkeypatch, tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread waiting for a busy core costs more than it gives
    recipe = tmp_path / "seg.yaml"
    recipe.write_text("encoder: mlla_tiny.in1k\npretrained: true\ndecoder: unet\n")
    start = timm.create_model("mlla_tiny", **ONE_BLOCK)
    path = str(tmp_path / "encoder.pth")
    torch.save(start.state_dict(), path)
    try:
        out = run_tool("train_seg.py", "--config", str(recipe), "--pretrained-path", path, "--dataset",
                       "mosaic", "--mosaic-size", "128", "--mosaic-train", "4", "--mosaic-val", "2", "--img-size",
                       "64", "--model-kwargs", "depths=[1,1,1,1]", "--decoder-kwargs",
                       "decoder_channels=[32,16,16,8,8]", "-b", "4", "--epochs", "1", "--stop-after-steps", "1",
                       "--lr", "1e-12", "--warmup-lr", "1e-12", "--min-lr", "1e-12", "--weight-decay", "0",
                       "--output", str(tmp_path), "--experiment", "seg", "--no-progress", "--device", "cpu").stdout
    finally:
        torch.set_num_threads(threads)
    assert "replaces the config's pretrained: true" in out and asked == []
    assert yaml.safe_load((tmp_path / "seg" / "config.yaml").read_text())["pretrained"] is False
    tuned = load_file(str(tmp_path / "seg" / "last" / "model.safetensors"))
    encoder = {k.removeprefix("encoder.model.model."): v for k, v in tuned.items()
               if k.startswith("encoder.model.model.")}
    reference = {k: v for k, v in start.state_dict().items() if k in encoder and not k.startswith("final.")}
    assert _same_weights(encoder, reference) > 20


def test_no_pretrained_turns_the_recipe_off(tmp_path, monkeypatch):
    """--config finetune_mlla_tiny --no-pretrained: random weights, nothing downloaded, no note, and config.yaml
    records pretrained: false."""
    asked = _offline(monkeypatch, tmp_path)
    data = write_image_folder(tmp_path / "data", classes=3, size=32)
    out = run_tool("train.py", *_tiny_recipe(data, tmp_path, "--experiment", "scratch", "--no-pretrained",
                                             "--stop-after-steps", "1")).stdout
    assert asked == [] and "pretrained:" not in out
    recorded = yaml.safe_load((tmp_path / "scratch" / "config.yaml").read_text())
    assert recorded["pretrained"] is False and recorded["pretrained_path"] is None


def test_both_typed_is_refused_in_one_line(tmp_path, monkeypatch):
    """--pretrained and --pretrained-path both typed (with or without a recipe): status 2, one line, before any
    download or run folder."""
    asked = _offline(monkeypatch, tmp_path)
    data = write_image_folder(tmp_path / "data", classes=3, size=32)
    path = str(tmp_path / "w.pth")
    for flags in (_tiny_recipe(data, tmp_path, "--pretrained", "--pretrained-path", path),
                  _tiny_recipe(data, tmp_path, "--pretrained-path", path, "--pretrained")[2:]):
        proc = run_tool("train.py", *flags, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("error: pretrained: give --pretrained") and "not both" in proc.stderr
    seg = run_tool("train_seg.py", "--dataset", "mosaic", "--encoder", "mlla_tiny.in1k", "--pretrained",
                   "--pretrained-path", path, "--output", str(tmp_path), "--device", "cpu", check=False)
    assert seg.returncode == 2 and len(seg.stderr.strip().splitlines()) == 1 and "not both" in seg.stderr
    assert asked == [] and not list(tmp_path.glob("finetune*")) and not list(tmp_path.glob("unet*"))


@pytest.mark.parametrize("tool", ["train", "train_seg"])
def test_flags_typed_win_over_the_config_file(tool, tmp_path, capsys):
    """Parsing alone: each of the two weight flags typed replaces the other set by a config file (with a note);
    --no-pretrained exists; --help shows the pair."""
    import importlib

    from linvision.utils.config import parse_args

    parser = importlib.import_module(f"linvision.tools.{tool}").build_parser
    on, local = tmp_path / "on.yaml", tmp_path / "local.yaml"
    on.write_text("pretrained: true\n")
    local.write_text("pretrained_path: w.pth\n")

    def parse(*argv):
        args = parse_args(parser(), list(argv))
        return args.pretrained, args.pretrained_path

    assert parse("--config", str(on)) == (True, None)
    assert parse("--config", str(on), "--no-pretrained") == (False, None)
    assert parse("--config", str(on), "--pretrained-path", "x.pth") == (False, "x.pth")
    assert "replaces the config's pretrained: true" in capsys.readouterr().out
    assert parse("--config", str(local), "--pretrained") == (True, None)
    assert "replaces the config's pretrained_path w.pth" in capsys.readouterr().out
    assert parse("--config", str(local)) == (False, "w.pth")
    assert parse("--pretrained", "--pretrained-path", "x") == (True, "x")  # for check() to refuse
    assert parse("--config", str(on), "--pretrained", "--pretrained-path", "x") == (True, "x")
    assert capsys.readouterr().out == ""
    assert "--pretrained, --no-pretrained" in parser().format_help()
