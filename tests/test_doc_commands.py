"""Every command line of the shell blocks of README.md and of the manual (docs/**/*.md) runs as printed.

The commands are read from the pages' fenced blocks marked bash, sh, shell, console or nothing: continuation lines
joined, comments dropped, ``NAME="..."`` lines kept as the variables of the lines after them, and a ``$ `` line's
printed output (the lines below it) kept as what it must print. In an unmarked block only lines that start with a
command (linvision-..., python, torchrun, make, pip) are commands, as such a block may hold Python or output; in a
block marked as shell every line is one (curl, mkdir, ... too).

Each command is either run, in CHAINS, or skipped, in SKIPPED with the reason; a command that the pages show and
that is neither fails :func:`test_every_documented_command_is_run_or_skipped`, and so does an entry that no page
shows any more. A chain's commands run in order in one empty folder (a command that reads a run folder after the
one that wrote it), in a process of its own as a reader's shell would start it (without the tests'
TRITON_INTERPRET) with the chain's deadline, except the default chains' commands, which run their tool's entry
point in this process (saving a torch import each) within the test's deadline. What differs from the printed
line is in its step: ``subs`` swaps a word that the reader replaces with their own (a data folder such as
/data/pets, a path under /tmp) for what the chain wrote, and ``extra`` appends flags that make the run small (the
tools' parsers take the last value of a flag given twice), each with the reason in ``why``. The chains that run
in seconds run by default; the others are marked slow (``--runslow``). A chain whose printed command is known to
fail says why in ``fails`` and is a strict expected failure until it is fixed.
"""
import contextlib
import importlib
import glob
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import yaml
from support import (command_argv, fenced_blocks, joined_lines, write_ablation_json, write_image_folder,
                     write_rope_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(os.path.join(d, f), ROOT)
                               for d, _, files in os.walk(os.path.join(ROOT, "docs")) for f in files
                               if f.endswith(".md"))
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
COMMAND_START = re.compile(r"(linvision-[\w-]+|python|python3|torchrun|make|pip)(\s|$)")
VARIABLE = re.compile(r"[A-Z]\w*=.*", re.S)
BIN = os.path.dirname(sys.executable)


@dataclass(frozen=True)
class Documented:
    """A command line of a page: where, its text as printed (the key of CHAINS and SKIPPED), the block's
    variables set before it, and the output printed below a ``$ `` line."""
    page: str
    line: int
    text: str
    variables: Tuple[Tuple[str, str], ...] = ()
    output: str = ""




def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s+)#.*$", "", line).strip()


def commands_of(page: str, text: str) -> List[Documented]:
    """The commands of one page."""
    found = []
    for first, lang, body in fenced_blocks(text):
        if lang not in SHELL_BLOCKS:
            continue
        lines = joined_lines(body, first)
        prompted = any(line.startswith("$ ") for _, line in lines)
        variables: Dict[str, str] = {}
        for index, (number, line) in enumerate(lines):
            if prompted:  # a session: commands after "$ ", what they print below them
                if not line.startswith("$ "):
                    continue
                output = []
                for _, after in lines[index + 1:]:
                    if after.startswith("$ "):
                        break
                    output.append(after)
                found.append(Documented(page, number, _strip_comment(line[2:]), (), "\n".join(output).strip()))
                continue
            code = _strip_comment(line)
            if not code:
                continue
            words = shlex.split(code)
            if all(VARIABLE.fullmatch(w) for w in words):
                variables.update(w.split("=", 1) for w in words)
            elif lang or COMMAND_START.match(code):
                found.append(Documented(page, number, " ".join(code.split()), tuple(variables.items())))
    return found


def documented_commands() -> List[Documented]:
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            found += commands_of(page, f.read())
    return found


@dataclass(frozen=True)
class Step:
    """One command of a chain: ``command`` exactly as :func:`documented_commands` gives it, the changes made to it
    (``subs``: printed word -> replacement, ``{name}`` filled from the chain's setup; ``extra``: flags appended)
    with the reason, and a check of what it did (called with the folder and the completed process)."""
    command: str
    extra: Tuple[str, ...] = ()
    subs: Dict[str, str] = field(default_factory=dict)
    why: str = ""
    check: Optional[Callable] = None


@dataclass(frozen=True)
class Chain:
    steps: Tuple[Step, ...]
    slow: bool = True
    setup: Optional[Callable] = None  # writes what the chain reads into its folder; returns {name: path}
    timeout: int = 1800  # seconds for each command
    fails: str = ""  # a known failure of the printed command, and why: expected (strict), until it is fixed


# --- what the chains write and check -------------------------------------------------------------------------

def _pets(folder):
    """An image folder in the layout /data/pets stands for: 3 classes, 4 training and 2 validation images each."""
    return {"pets": write_image_folder(os.path.join(folder, "pets"), size=32)}


def _pets_and_weights(folder):
    """The image folder, and linhier_tiny_224's weights as a file of one's own (a fresh model's, 1000 classes)."""
    import timm
    from safetensors.torch import save_file

    import linvision  # noqa: F401  registers the models

    path = os.path.join(folder, "weights.safetensors")
    save_file(timm.create_model("linhier_tiny_224").state_dict(), path)
    return {**_pets(folder), "weights": path}


def _scenes(folder):
    """Image/mask folders in the layout /data/scenes stands for: mosaics, so a mosaic-trained segmenter's classes."""
    from linvision.data.mosaic import write_mosaic_folders

    return {"scenes": write_mosaic_folders(os.path.join(folder, "scenes"), size=128, train=2, val=2)}


def _rope_run(folder):
    """output/rope_run: a checkpoint of a small random linvit with RoPE, trained size 96 px at patch 8, whose
    model.json records the digits."""
    write_rope_checkpoint(os.path.join(folder, "output", "rope_run"))
    return {}


def _seed_ablations(folder):
    """runs/fine_s0, fine_s1, fine_s2: one seed's ablation.json each, made-up scores (50 + seed), nothing trained."""
    for seed in range(3):
        write_ablation_json(os.path.join(folder, "runs", f"fine_s{seed}"), seeds=(seed,))
    return {}


def _merged(folder, proc):
    with open(os.path.join(folder, "runs", "fine_3seeds", "ablation.json")) as f:
        (row,) = json.load(f)["rows"]
    assert row["accuracy_seeds"]["32"] == [50.0, 51.0, 52.0] and row["accuracy"]["32"] == 51.0, row
    assert "| linear | 1.000 | 0.5000 | 51.00 ± 1.00 |" in proc.stdout, proc.stdout


def _records(folder):
    """The mean-pooled ViT-Tiny runs' records, as the repository keeps them, under the chain's folder."""
    shutil.copytree(os.path.join(ROOT, "docs", "records"), os.path.join(folder, "docs", "records"))
    return {}


def _merged_records(folder, proc):
    """docs/results.md's mean-pooled runs from their records: seeds at 96 px, linear's and inline's means."""
    with open(os.path.join(folder, "runs", "fine_avg_table", "ablation.json")) as f:
        rows = {row["mixer"]: row for row in json.load(f)["rows"]}
    for mixer, seeds in (("softmax", [92.5, 92.5, 93.33]), ("linear", [91.67, 92.71, 91.88]),
                         ("agent", [91.88, 92.08, 93.12]), ("inline", [90.42, 94.17, 92.5]),
                         ("bidir_delta", [96.04, 96.25, 96.25])):
        assert [round(a, 2) for a in rows[mixer]["accuracy_seeds"]["96"]] == seeds, rows[mixer]
    for row in ("| linear | 5.406 | 0.8125 | 92.08 ± 0.55 | 92.57 ± 0.64 | 93.61 ± 0.96 |",
                "| inline | 5.491 | 0.8291 | 92.36 ± 1.88 | 92.08 ± 2.11 | 92.15 ± 2.00 |",
                "mean ± sample standard deviation over seeds 0, 1, 2"):
        assert row in proc.stdout, proc.stdout


def _merged_scale_records(folder, proc):
    """docs/results.md's varied-scale table from its records: the seeds at 96 px of softmax, the focused map, pola,
    plain linear, `linear_rope` and the 9+3 hybrid, and the rows of means of softmax and the focused map."""
    with open(os.path.join(folder, "runs", "scale_table", "ablation.json")) as f:
        rows = {row["mixer"]: row for row in json.load(f)["rows"]}
    for mixer, seeds in (("softmax", [86.25, 90.42, 87.29]),
                         ("linear (mixer_kwargs.feature_map='focused')", [86.88, 90.42, 87.29]),
                         ("pola", [88.96, 85.83, 91.46]), ("linear", [80.62, 85.21, 78.54]),
                         ("linear_rope (mixer_kwargs.rope_ref_grid=12)", [80.62, 81.04, 81.88]),
                         ("9xlinear+3xsoftmax", [83.12, 88.54, 85.42])):
        assert [round(a, 2) for a in rows[mixer]["accuracy_seeds"]["96"]] == seeds, rows[mixer]
    for row in ("| softmax | 5.406 | 0.8719 | 87.99 ± 2.17 | 89.38 ± 2.53 | 90.07 ± 1.58 |",
                "| linear (mixer_kwargs.feature_map='focused') | 5.407 | 0.8181 | 88.19 ± 1.94 | "
                "90.35 ± 1.54 | 90.28 ± 1.42 |",
                "mean ± sample standard deviation over seeds 0, 1, 2"):
        assert row in proc.stdout, proc.stdout


def _report(folder):
    return {"report": os.path.join(folder, "report")}


def _json(proc):
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def _summary(run):
    """The run folder output/``run`` (a glob: a run named after its model has the time after the name) holds a
    summary with a best epoch."""
    def check(folder, proc):
        (path,) = glob.glob(os.path.join(folder, "output", run, "summary.json"))
        with open(path) as f:
            summary = json.load(f)
        assert summary["best_epoch"] >= 0, summary
    return check


def _opened_and_trained(run, opening):
    """The run's first line of output starts with ``opening`` (the opening line: model, data, device, threads) and
    it trained (:func:`_summary`)."""
    def check(folder, proc):
        assert proc.stdout.splitlines()[0].startswith(opening), proc.stdout[:500]
        _summary(run)(folder, proc)
    return check


def _focused_run(folder, proc):
    """README's from-scratch line trained linvit with the focused feature map it prints."""
    _opened_and_trained("linvit_tiny_patch16_224-*", "training linvit_tiny_patch16_224 (")(folder, proc)
    (config,) = glob.glob(os.path.join(folder, "output", "linvit_tiny_patch16_224-*", "config.yaml"))
    from linvision.utils.config import parse_kwargs

    with open(config) as f:  # the flags as given (key=value words), read as the tool reads them
        assert parse_kwargs(yaml.safe_load(f)["model_kwargs"])["mixer_kwargs"] == {"feature_map": "focused"}


def _validated(sizes, count=None, data=None):
    """linvision-validate printed a score (not an error) at each of ``sizes``, on ``count`` images, and named the
    data it took from the run's record (``data``: a path under the chain's folder, or a dataset name)."""
    def check(folder, proc):
        results = _json(proc)["results"]
        assert [r["img_size"] for r in results] == sizes, results
        assert all("error" not in r for r in results), results
        if count is not None:
            assert all(r["count"] == count for r in results), results
        if data is not None:
            where = os.path.join(folder, data) if "/" in data else data
            assert proc.stderr.startswith(f"data: ") and where in proc.stderr.splitlines()[0], proc.stderr
    return check


def _segmented(sizes):
    def check(folder, proc):
        results = _json(proc)["results"]
        assert [r["img_size"] for r in results] == sizes and all(0 <= r["miou"] <= 100 for r in results), results
    return check


def _refused_as_printed(message):
    """The command fails with status 2 and prints ``message`` (the page's output, its lines joined)."""
    def check(folder, proc):
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert " ".join(proc.stderr.split()) == " ".join(message.split())
    return check


def _files(*names):
    def check(folder, proc):
        for name in names:
            assert os.path.getsize(os.path.join(folder, name)) > 0, name
    return check


def _traffic_rows_of_the_manual(folder, proc):
    """The counted row of N = 1024 is the one of docs/kernels.md's table (forward 1.063x, backward 1.054x)."""
    row = next(line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["1024"])
    assert (row[4], row[7]) == ("1.063", "1.054"), proc.stdout


EPOCH = ("--epochs", "1")
ONE_EPOCH = "one epoch shows that the recipe runs; the page's figures need all of them"
TINY_FOLDER = "the chain's tiny folder, 12 training images: batches of 4"

CHAINS: Dict[str, Chain] = {
    # README: fine-tune, then the same weights at 3 sizes (the validator finds the run's data folder itself)
    "readme_finetune": Chain(setup=_pets, slow=False, timeout=600, steps=(
        Step("linvision-train --config finetune_mlla_tiny --data-dir /data/pets", subs={"/data/pets": "{pets}"},
             extra=("--no-pretrained", "--model-kwargs", "depths=[1,1,1,1]", "dims=[32,64,96,128]",
                    "num_heads=[1,2,3,4]", "--img-size", "32", "-b", "4", *EPOCH, "--no-progress", "--device", "cpu"),
             why="no download (the weights); one narrow block per stage at 32 px; " + TINY_FOLDER + "; " + ONE_EPOCH,
             check=_summary("finetune_mlla_tiny")),
        # from scratch on the same folder, nothing downloaded; the opening line says what is trained on what
        Step("linvision-train --model linvit_tiny_patch16_224 --data-dir /data/pets --img-size 96 "
             "--model-kwargs \"mixer_kwargs={feature_map: focused}\"",
             subs={"/data/pets": "{pets}"},
             extra=("--model-kwargs", "mixer_kwargs={feature_map: focused}", "embed_dim=16", "depth=1", "num_heads=1",
                    "--img-size", "32", "-b", "4", *EPOCH, "--no-progress", "--device", "cpu"),
             why="one narrow block at 32 px (the printed focused map kept); " + TINY_FOLDER + "; " + ONE_EPOCH,
             check=_focused_run),
        Step("linvision-validate --checkpoint output/finetune_mlla_tiny --img-size 224 288 384",
             check=_validated([224, 288, 384], count=6, data="pets")),
    )),
    "tools_refused_size": Chain(slow=False, timeout=600, steps=(
        Step("linvision-train --dataset digits --model linvit_tiny_patch16_pola_224 --img-size 100"),
    )),
    # the same weights with RoPE positions interpolated, at three sizes (a random model: the command, not a score)
    "validate_rope_ref_grid": Chain(setup=_rope_run, slow=False, timeout=600, steps=(
        Step("linvision-validate --checkpoint output/rope_run --img-size 96 144 192 "
             "--model-kwargs '{\"mixer_kwargs\": {\"rope_ref_grid\": 12}}'",
             check=_validated([96, 144, 192], count=360, data="digits")),
    )),
    # ablations of one seed each, joined (made-up ablation.json files: the command, not a score)
    "ablate_merge": Chain(setup=_seed_ablations, slow=False, timeout=300, steps=(
        Step("linvision-ablate --merge runs/fine_s0 runs/fine_s1 runs/fine_s2 --output runs --experiment fine_3seeds",
             check=_merged),
    )),
    # the mean-pooled ViT-Tiny runs' records in docs/records, joined: the results page's three-seed means
    "ablate_merge_records": Chain(setup=_records, slow=False, timeout=300, steps=(
        Step("linvision-ablate --merge docs/records/photos_fine/fine_avg_softmax_s0 "
             "docs/records/photos_fine/fine_avg_softmax_s1 docs/records/photos_fine/fine_avg_softmax_s2 "
             "docs/records/photos_fine/fine_avg_linear_s0 docs/records/photos_fine/fine_avg_linear_s1 "
             "docs/records/photos_fine/fine_avg_linear_s2 docs/records/photos_fine/fine_avg_agent_s0 "
             "docs/records/photos_fine/fine_avg_agent_s1 docs/records/photos_fine/fine_avg_agent_s2 "
             "docs/records/photos_fine/fine_avg_inline_s0 docs/records/photos_fine/fine_avg_inline_s1 "
             "docs/records/photos_fine/fine_avg_inline_s2 docs/records/photos_fine/fine_avg_bidir_delta_s0 "
             "docs/records/photos_fine/fine_avg_bidir_delta_s1 docs/records/photos_fine/fine_avg_bidir_delta_s2 "
             "--output runs --experiment fine_avg_table", check=_merged_records),
    )),
    # the ViT-Tiny runs on photographs at varied scale, from their records: the results page's table
    "ablate_merge_scale_records": Chain(setup=_records, slow=False, timeout=300, steps=(
        Step("linvision-ablate --merge " + " ".join(
            f"docs/records/photos_scale/scale_{run}" for run in (
                "softmax_s0", "softmax_s1", "softmax_s2", "linear_focused_s0", "linear_focused_s1",
                "linear_focused_s2", "pola_s0", "pola_s1", "pola_s2", "linear_s0", "linear_s1", "linear_s2",
                "linear_rope_s0", "linear_rope_s1", "linear_rope_s2",
                "hybrid_s0", "hybrid_s1", "hybrid_s2", "avg_softmax_s0", "avg_softmax_s1",
                "avg_softmax_s2", "avg_linear_s0", "avg_linear_s1", "avg_linear_s2"))
             + " --output runs --experiment scale_table", check=_merged_scale_records),
    )),
    "naflex_native": Chain(steps=(
        Step("linvision-train --dataset photos_aspect --model linvit_tiny_patch16_rope_224 --naflex-loader "
             "--naflex-train-seq-lens 64 --naflex-max-seq-len 64 --epochs 30 --experiment native",
             extra=(*EPOCH, "--model-kwargs", "depth=1"), why=ONE_EPOCH + "; one block",
             check=_summary("native")),
        Step("linvision-validate --checkpoint output/native --naflex-loader --naflex-max-seq-len 64"),
    )),
    "naflex_photos": Chain(steps=(
        Step("linvision-train -c naflex_photos --naflex-loader --seed 0 --experiment naflex-s0",
             extra=(*EPOCH, "--output", "output"), why=ONE_EPOCH + "; the run folder in the chain's folder, not "
             "/tmp", check=_summary("naflex-s0")),
        Step("linvision-train -c naflex_photos --seed 0 --experiment square-s0",
             extra=(*EPOCH, "--output", "output"), why=ONE_EPOCH + "; the run folder in the chain's folder, not "
             "/tmp", check=_summary("square-s0")),
        Step("linvision-validate --checkpoint /tmp/naflex_photos/naflex-s0/last --naflex-loader "
             "--naflex-max-seq-len 64",
             subs={"/tmp/naflex_photos/naflex-s0/last": "output/naflex-s0/last"}, why="the run the chain trained"),
        Step("linvision-validate --checkpoint /tmp/naflex_photos/naflex-s0/last --naflex-loader "
             "--naflex-max-seq-len 128",
             subs={"/tmp/naflex_photos/naflex-s0/last": "output/naflex-s0/last"}, why="the run the chain trained"),
        Step("linvision-validate --checkpoint /tmp/naflex_photos/naflex-s0/last",
             subs={"/tmp/naflex_photos/naflex-s0/last": "output/naflex-s0/last"}, why="the run the chain trained"),
    )),
    "digits_demo": Chain(steps=(
        Step("linvision-train --config digits_demo", extra=EPOCH, why=ONE_EPOCH, check=_summary("digits_demo")),
        Step("linvision-validate --checkpoint output/digits_demo --img-size 32 64 128 --output val.json",
             check=_validated([32, 64, 128], count=360, data="digits")),
        Step("linvision-export --checkpoint output/digits_demo --output digits.pt2", check=_files("digits.pt2")),
        Step("linvision-train --resume output/digits_demo --epochs 10", extra=("--epochs", "2"),
             why="one epoch more than the run has is what resuming needs to show"),
    )),
    "digits_demo_ddp": Chain(steps=(
        Step("torchrun --nproc_per_node 2 -m linvision.tools.train --config digits_demo", extra=EPOCH,
             why=ONE_EPOCH, check=_summary("digits_demo")),
    )),
    "tools_initial_checkpoint": Chain(setup=_pets_and_weights, steps=(
        Step("linvision-train --dataset folder --data-dir /data/pets --model linhier_tiny_224 --initial-checkpoint "
             "weights.safetensors --img-size 224 --epochs 30 -b 64 -j 4 --amp --model-ema",
             subs={"/data/pets": "{pets}"}, extra=("-b", "4", "--img-size", "64", *EPOCH),
             why=TINY_FOLDER + ", 64 px (224 px under bf16 autocast on a busy CPU took over 15 minutes); " + ONE_EPOCH),
    )),
    "segmentation": Chain(setup=_scenes, steps=(
        Step('linvision-train-seg --dataset mosaic --mosaic-size 128 --mosaic-train 64 --mosaic-val 16 --img-size 96 '
             '--encoder linhier_delta_femto_224 --model-kwargs "depths=[1,1,1,1]" --epochs 5 -b 8 --lr 1e-3 '
             '--experiment seg_mosaics', extra=EPOCH, why=ONE_EPOCH, check=_summary("seg_mosaics")),
        Step("linvision-train-seg --resume output/seg_mosaics --epochs 10", extra=("--epochs", "2"),
             why="one epoch more than the run has is what resuming needs to show"),
        Step("linvision-validate --checkpoint output/seg_mosaics --img-size 128 256 512",
             check=_segmented([128, 256, 512])),
        Step("linvision-validate --checkpoint output/seg_mosaics --dataset folder --data-dir /data/scenes "
             "--img-size 512 1024", subs={"/data/scenes": "{scenes}"},
             why="a folder of 2 validation mosaics for /data/scenes (the run's classes)",
             check=_segmented([512, 1024])),
    )),
    "tools_seg_mosaics": Chain(steps=(
        Step("linvision-train-seg --dataset mosaic --mosaic-size 128 --mosaic-train 64 --mosaic-val 16 "
             "--img-size 96 --encoder linhier_delta_femto_224 --epochs 5 -b 8 --lr 1e-3", extra=EPOCH,
             why=ONE_EPOCH),
    )),
    "seg_dpt": Chain(steps=(
        Step("linvision-train-seg --dataset mosaic --encoder linvit_tiny_patch16_rope_224 --decoder dpt "
             "--img-size 224", extra=("--mosaic-size", "256", "--mosaic-train", "8", "--mosaic-val", "4", "-b", "4",
                                      *EPOCH),
             why="8 training and 4 validation mosaics of 256 px (not 1000 and 200 of 512 px); " + ONE_EPOCH),
    )),
    # two processes: DDP checks that every parameter of the features-only encoder gets a gradient
    "seg_ddp": Chain(steps=(
        Step("torchrun --nproc_per_node 2 -m linvision.tools.train_seg --dataset mosaic --encoder mlla_tiny --amp",
             extra=("--mosaic-size", "128", "--mosaic-train", "8", "--mosaic-val", "4", "--img-size", "128",
                    "-b", "2", *EPOCH),
             why="8 training and 4 validation mosaics of 128 px (not 1000 and 200 of 512 px); " + ONE_EPOCH),
    )),
    "linearization": Chain(steps=(
        Step("linvision-train --config linearize_digits_teacher", extra=EPOCH, why=ONE_EPOCH),
        Step("linvision-linearize --config linearize_digits", extra=("--steps", "5"),
             why="5 of the 200 transfer steps show that stage 1 runs"),
        Step("linvision-train --config linearize_digits_student --initial-checkpoint "
             "output/linearized_digits.safetensors --experiment linearize_student", extra=EPOCH, why=ONE_EPOCH),
        Step("linvision-train --config linearize_digits_student --experiment linearize_scratch",
             extra=EPOCH, why=ONE_EPOCH),
        Step("linvision-validate --checkpoint output/linearize_student/last --dataset digits --img-size 32 48 64",
             check=_validated([32, 48, 64], count=360)),
    )),
    "diffusion_digits": Chain(steps=(
        Step("python linvision/tools/train.py --config digits_demo --model linvit_tiny_patch16_rope_224 "
             "--model-kwargs patch_size=4 embed_dim=96 depth=4 num_heads=3 --epochs 30 --experiment "
             "digits_linvit_cls30", extra=EPOCH, why=ONE_EPOCH),
        Step("linvision-train-diffusion --config diffusion_digits", extra=("--steps", "20"),
             why="20 of the 500 steps show that training runs"),
        Step("linvision-sample-diffusion output/diffusion_digits --per-class 10 --steps 20 --cfg-scale 3"),
        Step("linvision-eval-diffusion-samples output/diffusion_digits output/digits_linvit_cls30 "
             "--per-class 50 --cfg-scale 3", extra=("--per-class", "5"), why="5 samples of each class, not 50"),
        Step("linvision-train-diffusion --config diffusion_digits --model-kwargs "
             "self_attn=bidir_delta --experiment diffusion_digits_bidir_delta", extra=("--steps", "20"),
             why="20 of the 500 steps show that training runs"),
        Step("linvision-eval-diffusion-samples output/diffusion_digits_bidir_delta output/digits_linvit_cls30 "
             "--per-class 50 --cfg-scale 1 --steps 20", extra=("--per-class", "5"),
             why="5 samples of each class, not 50"),
    )),
    "ablate_digits": Chain(steps=(
        Step("linvision-ablate --config ablate_digits", extra=EPOCH, why=ONE_EPOCH),
        Step("linvision-ablate --config ablate_digits --mixers none linear linear_rope softmax causal "
             "hybrid", extra=EPOCH, why=ONE_EPOCH),
    )),
    "ablate_recurrent": Chain(steps=(
        Step("linvision-ablate --config ablate_digits --mixers linear bidir_decay bidir_gated "
             "bidir_delta --experiment ablate_recurrent", extra=EPOCH, why=ONE_EPOCH),
    )),
    "vit_twin_heads": Chain(steps=tuple(Step(c, extra=EPOCH, why=ONE_EPOCH) for c in (
        "linvision-train -c vit_twin_photos --model vit_tiny_patch16_224 --model-kwargs patch_size=8 "
        "img_size=64 --seed 0",
        "linvision-train -c vit_twin_photos $V class_token=False global_pool=avg fc_norm=False --seed 0",
        "linvision-train -c vit_twin_photos $V class_token=False global_pool=avg fc_norm=False --seed 0 "
        "--mean 0.5 0.5 0.5 --std 0.5 0.5 0.5",
        "linvision-train -c vit_twin_photos $V class_token=False global_pool=avg fc_norm=True --seed 0",
        "linvision-train -c vit_twin_photos $V --seed 0",
    ))),
    "vit_twin_mixers": Chain(steps=tuple(Step(c, extra=EPOCH, why=ONE_EPOCH) for c in (
        "linvision-train -c vit_twin_photos $R token_mixer=softmax --seed 0",
        "linvision-train -c vit_twin_photos $R token_mixer=linear_rope --seed 0",
        "linvision-train -c vit_twin_photos $R token_mixer=bidir_delta class_token=False "
        "global_pool=avg fc_norm=False --seed 0",
    ))),
    "rope_positions": Chain(steps=(
        Step("linvision-train -c vit_twin_photos $R token_mixer=softmax pos_embed=learn --seed 0 "
             "--experiment rope_abs", extra=EPOCH, why=ONE_EPOCH),
        Step("linvision-train -c vit_twin_photos $R token_mixer=softmax rope=mixed --seed 0 "
             "--experiment rope_mixed", extra=EPOCH, why=ONE_EPOCH),
        Step("linvision-validate --checkpoint output/rope_abs --img-size 64 96 128"),
        Step('linvision-train -c vit_twin_photos $R token_mixer=softmax "mixer_kwargs={rope_theta: 10000}" '
             '--seed 0 --experiment rope_theta', extra=EPOCH, why=ONE_EPOCH),
        Step('linvision-train -c vit_twin_photos $R token_mixer=softmax "mixer_kwargs={rope_origin: centre}" '
             '--seed 0 --experiment rope_centre', extra=EPOCH, why=ONE_EPOCH),
        Step('linvision-train -c vit_twin_photos $R token_mixer=linear_rope '
             '"mixer_kwargs={rope_origin: centre}" --seed 0 --experiment rope_centre_linear', extra=EPOCH,
             why=ONE_EPOCH),
        Step('linvision-train -c vit_twin_photos $R token_mixer=softmax "mixer_kwargs={rope_fraction: 0.5}" '
             '--seed 0 --experiment rope_half', extra=EPOCH, why=ONE_EPOCH),
        Step("linvision-train -c vit_twin_photos --model linvit_tiny_patch16_224 --model-kwargs "
             "patch_size=8 img_size=64 --seed 0 --experiment linear_abs", extra=EPOCH, why=ONE_EPOCH),
    )),
    "bench_core_op": Chain(steps=(
        Step("linvision-benchmark --model linhier_tiny_224:token_mixers=linear_rope "
             "linhier_tiny_224:token_mixers=bidir_delta linhier_tiny_224:token_mixers=bidir_gated --twin "
             "linhier_tiny_224:token_mixers=linear_rope --img-size 512 -b 1 --threads 1 --warmup 1 --iters 3 --train",
             extra=("--img-size", "224", "--iters", "1"), why="224 px and one timed call: it shows the sweep runs"),
    )),
    "bench_twin_by_name": Chain(steps=(
        Step("linvision-benchmark --config benchmark_twin_cpu", extra=("--img-size", "224", "--iters", "1"),
             why="224 px of 224-1024 and one timed call"),
    )),
    "bench_seg_twin": Chain(steps=(
        Step("linvision-benchmark --config benchmark_seg_twin_cpu",
             extra=("--img-size", "256", "--iters", "1"), why="256 px only and one timed call (18 min in full)"),
    )),
    "bench_resolutions": Chain(steps=(
        Step("python linvision/tools/benchmark.py --models linvit_small_patch16_224 linvit_small_patch16_rope_224 "
             "vit_small_patch16_224 mambaout_femto --img-size 224 512 1024 --batch-size 1 --no-train --warmup 2 "
             "--iters 5 --threads 2", extra=("--img-size", "224", "--iters", "1"), why="224 px and one timed call"),
    )),
    "bench_isotropic_mixers": Chain(steps=(
        Step("linvision-benchmark --models vit_tiny_patch16_224 $M:token_mixer=softmax,$H "
             "$M:token_mixer=linear_rope,$H $M:token_mixer=mala,$H $M:token_mixer=rala_premod,$H "
             "$M:token_mixer=inline,$H $M:token_mixer=bidir_delta,$H $M:token_mixer=pola,$H --model-kwargs "
             "patch_size=8 --img-size 96 -b 64 --warmup 1 --iters 3 --threads 2 --twin $M:token_mixer=softmax,$H",
             extra=("-b", "8", "--iters", "1"),
             why="batches of 8 and one timed call"),
    )),
    "bench_gemm_rate": Chain(steps=(
        Step("linvision-benchmark --models linvit_small_patch16_224 linvit_small_patch16_rope_224 --img-size 1024 "
             "-b 1 --no-train --gemm-rate --threads 2", extra=("--img-size", "224"), why="224 px, not 1024"),
    )),
    "bench_cpu": Chain(steps=(
        Step("linvision-benchmark --config benchmark_cpu", extra=("--img-size", "224", "--iters", "1"),
             why="224 px of 224-896 and one timed call"),
    )),
    "bench_tools_example": Chain(steps=(
        Step("linvision-benchmark --model linhier_tiny_224 mambaout_tiny --img-size 224 512 -b 1 --iters 10",
             extra=("--img-size", "224", "--iters", "1", "--device", "cpu"),
             why="224 px, one timed call, on the CPU where a GPU is there too"),
    )),
    "bench_kernels": Chain(steps=(
        Step("linvision-bench-kernels", extra=("--n", "1024"),
             why="N = 1024 of 1024-16384: the interpreter takes over 15 minutes for all of them",
             check=_traffic_rows_of_the_manual),
    )),
    "check_fla_kernels": Chain(steps=(
        Step("linvision-check-kernels --fla --form bidir_delta --d 32 --dtype float16"),
    )),
    "gpu_report_dry_run": Chain(setup=_report, steps=(
        Step("linvision-gpu-report --dry-run --output /tmp/report", subs={"/tmp/report": "{report}"},
             extra=("--models", "vit_small_patch16_224", "linvit_small_patch16_rope_224:token_mixer=softmax",
                    "--first-models", "vig_tiny"),
             why="the report goes into the chain's folder, not /tmp; two models of nine (each a minute on 2 cores)",
             check=_files("report/report.md", "report/report.json")),
    )),
    "bench_diffusion_parallel": Chain(steps=(
        Step("linvision-bench-diffusion-parallel --depth 4 --ranks 1 2 --out fsdp_memory",
             extra=("--depth", "1", "--steps", "2"), why="one block and two steps a point (over 15 minutes with 4 "
                                                         "blocks on 2 cores)",
             check=_files("fsdp_memory.md", "fsdp_memory.json")),
        Step("linvision-bench-diffusion-parallel --out fsdp_memory",
             extra=("--ranks", "1", "--depth", "1", "--steps", "2"),
             why="one rank (the two-rank points ran in the command before), one block and two steps a point"),
    )),
    "bench_diffusion_block": Chain(steps=(
        Step("linvision-bench-diffusion-block --tokens 1024 4096 --repeats 10", extra=("--repeats", "1"),
             why="one timed forward at each point"),
    )),
}

NETWORK = "downloads published weights (timm's pretrained=True): no network in the tests"
SKIPPED: Dict[str, str] = {
    "make demo": "the same as `linvision-ablate --config ablate_digits`, which runs (chain "
                 "ablate_digits)",
    "linvision-bench-naflex --budgets 256 1024 4096 16384 --modes infer train --batch 2 --batches 2 --iters 3 "
    "--warmup 1 --max-run-s 20 --threads 1 --device cpu --output docs/figures/naflex_throughput_memory.csv --plot "
    "docs/figures/naflex_throughput_memory.png": "the manual's 18-minute measurement, which rewrites its figure; "
    "tests/test_bench_naflex.py runs the tool on tiny budgets and checks its rows",
    "make test": "the test suite itself",
    "make docs": "the manual's strict build, which tests/test_docs.py runs",
    "pip install .": "installs the package: the tests run in such an install",
    'pip install -e ".[dev]"': "installs the package with the tests' dependencies: the tests run in such an install",
    'pip install ".[diffusers]"': "installs an extra from the package index (network)",
    'pip install ".[onnx]"': "installs an extra from the package index (network)",
    'pip install ".[seg]"': "installs an extra from the package index (network)",
    'pip install ".[kernels]"': "installs an extra from the package index (network)",
    'pip install ".[docs]"': "installs an extra from the package index (network)",
    "linvision-train --model ravlt_small.in1k --pretrained --data-dir /data/pets --img-size 224 --epochs 30 -b 64 "
    "--lr 1e-4 --layer-decay 0.8 --amp --model-ema": NETWORK,
    "linvision-train --model mlla_tiny --pretrained --dataset folder --data-dir /data/pets --img-size 224 --epochs "
    "30": NETWORK,
    "torchrun --nproc_per_node 2 -m linvision.tools.train --config finetune_mlla_tiny --data-dir /data/pets":
        NETWORK + " (the recipe's mlla_tiny.in1k; its single-process run is chain readme_finetune)",
    "linvision-export --model mlla_tiny --pretrained --output mlla_tiny.onnx": NETWORK,
    "linvision-train-seg --encoder mlla_tiny.in1k --pretrained --decoder upernet --data-dir /data/scenes "
    "--num-classes 21 --img-size 512 --epochs 40 -b 8 --lr 2e-4 --amp --model-ema": NETWORK,
    "linvision-train-seg --encoder mlla_tiny.in1k --pretrained --decoder upernet --data-dir /data/scenes "
    "--img-size 512 --epochs 40 --amp --model-ema": NETWORK,
    "linvision-export --model ravlt_small --pretrained-path RAVLT_S.pth --output ravlt_s.onnx --check-sizes 224 "
    "320 512": "needs a local copy of the authors' RAVLT-S file, which is not distributed (tests/test_published.py "
               "loads files in its layout)",
    "linvision-train-seg --encoder mlla_tiny --pretrained-path MLLA-T.pth --decoder segformer --data-dir "
    "/data/scenes --num-classes 21": "needs a local copy of the authors' MLLA-T file, which is not distributed "
                                     "(tests/test_published.py loads files in its layout)",
    "linvision-train --dataset torch/cifar10 --data-dir /data/cifar --model linvit_tiny_patch16_rope_224 "
    "--img-size 32 --model-kwargs patch_size=4 token_mixer=softmax": "needs CIFAR-10 on disk (torchvision's "
                                                                    "download: network)",
    "linvision-train --resume checkpoint-12.pth.tar --model vit_small_patch16_224 --dataset folder --data-dir d":
        "needs a checkpoint written by timm's train.py (tests/test_engine.py resumes from one it writes)",
    "linvision-train-seg --resume output/seg_run": "seg_run stands for a run of one's own; resuming a segmenter "
                                                   "runs in chain segmentation",
    "python linvision/tools/export.py --model MODEL --output MODEL.onnx --check-sizes 224 320 512 --bench-sizes 512 1024 "
    "--bench-iters 3 --threads 2 --bench-out MODEL.json": "a template: MODEL stands for each model of the table",
    "linvision-benchmark --config benchmark": "a GPU sweep (bf16, batch 8, up to 2048 px)",
    "linvision-gpu-report": "on a GPU the full report; without one it is the --dry-run, which runs "
                            "(chain gpu_report_dry_run)",
    'linvision-gpu-report --parts tests --tests-k "delta or gated" --budget 900':
        "runs part of this test suite under pytest, from within it",
    "linvision-gpu-report --parts kernels recurrences --budget 300 --rec-n 16384 65536":
        "a GPU's sizes; without one the same parts run in the dry run (chain gpu_report_dry_run)",
    "linvision-gpu-report --parts models --model-modes eager --img-size 512 1024 2048":
        "a GPU's sizes; without one the models part runs in the dry run (chain gpu_report_dry_run)",
    "torchrun --nproc_per_node 4 --no-python linvision-train-diffusion --config diffusion_digits":
        "four processes; the same config in one process runs (chain diffusion_digits)",
    "torchrun --nproc_per_node 8 --no-python linvision-train-diffusion --config diffusion_sana_600m_finetune "
    "--parallel fsdp --grad-checkpointing": "8 GPUs and a local copy of Sana-600M's weights",
    "torchrun --nproc_per_node 2 --no-python linvision-train-diffusion --config diffusion_sana_600m_finetune "
    "--parallel fsdp --resume": "GPUs and the run of the FSDP command before it (Sana-600M's weights)",
    "linvision-bench-diffusion-block --vs-diffusers --model sana_600m_t2i --latent 32 32 --repeats 3 "
    "--threads 1": "two 600M-parameter transformers in float32 on the CPU: long, and more memory than the tests "
                   "may take",
    "linvision-bench-diffusion-block --timeout 240": "every point up to 64k tokens of softmax attention on the CPU: "
                                                     "hours",
    "linvision-bench-diffusion-block --tokens 1024 4096 16384 --parts": "16k tokens of softmax attention, "
                                                                         "part by part, on the CPU: long",
    "linvision-check-kernels": "184 compilations of a few seconds each (the smaller --fla check runs)",
    "linvision-check-kernels --candidates --d 128 --dtype bfloat16 --rope on": "every candidate "
                                                                               "configuration compiled: long",
    "linvision-check-kernels --fla --d 32 64 128 --dtype float16 bfloat16 --markdown": "over 15 CPU minutes (its "
                                                                                       "one-form line runs)",
    'curl -L -o mlla_tiny_in1k.pth "https://cloud.tsinghua.edu.cn/f/7a19712877cb4242889c/?dl=1"':
        "downloads the authors' file (network)",
    "mkdir -p ~/.cache/torch/hub/checkpoints && cp mlla_tiny_in1k.pth ~/.cache/torch/hub/checkpoints/":
        "places the downloaded file in the user's torch cache",
    "linvision-train --config finetune_mlla_tiny --data-dir /data/pets --pretrained-path mlla_tiny_in1k.pth":
        "needs the authors' MLLA-T file, which is not distributed (tests/test_published.py trains from a file in "
        "its layout); the recipe itself runs in chain readme_finetune",
    "linvision-ablate --config ablate_seg_mosaics": "a full ablation: about 25 minutes on 2 cores",
    "linvision-ablate --config ablate_variants_photos": "a full ablation: about 34 minutes",
    "linvision-ablate --config ablate_variants_photos_vit": "a full ablation: about 23 minutes",
    "linvision-ablate --config ablate_variants_digits": "a full ablation: about 22 minutes",
    "linvision-ablate --config ablate_vit_tiny_photos_fine": "ten ViT-Tiny trainings of 20 epochs: "
                                                                          "hours",
    "linvision-ablate --config ablate_vit_tiny_photos_fine_avg": "ten ViT-Tiny trainings of 20 "
                                                                              "epochs: hours",
    "linvision-ablate --config ablate_vit_tiny_photos_fine --mixers softmax linear --epochs 1 "
    "--warmup-epochs 0 --seeds 0 --output /tmp/photos_run --experiment short_1epoch": "two ViT-Tiny trainings of "
                                                                                      "one epoch: 40 minutes at "
                                                                                      "nice 19 on a loaded CPU",
    "linvision-validate --checkpoint runs/fine_rope_s0/runs/linear_rope --img-size 96 144 192 --model-kwargs "
    "'{\"mixer_kwargs\": {\"rope_ref_grid\": 12}}'":
        "reads a best checkpoint of the ViT-Tiny ablation's linear_rope runs: 20 epochs each, hours",
    "linvision-ablate --merge runs/fine_s0 runs/fine_s1 runs/fine_s2 runs/fine_pola_s0 runs/fine_pola_s1 "
    "runs/fine_pola_s2 runs/fine_rope_s0 runs/fine_rope_s1 runs/fine_rope_s2 runs/fine_linear_s2 "
    "runs/fine_hybrid_s0 runs/fine_hybrid_s1 runs/fine_hybrid_s2 runs/fine_linear_lepe_s0 "
    "runs/fine_linear_lepe_s1 runs/fine_linear_focused_s0 runs/fine_linear_focused_s1 "
    "runs/fine_linear_ropeonly_s0 runs/fine_linear_ropeonly_s1 runs/fine_linear_lepe_s2 "
    "runs/fine_linear_focused_s2 runs/fine_linear_ropeonly_s2 --output runs --experiment fine_table":
        "reads the ViT-Tiny ablation's folders, one seed each: 20 epochs a run, hours",
}


# --- running a command ------------------------------------------------------------------------------------------

def _scripts() -> Dict[str, str]:
    """Console-script name -> entry point ("module:function"), from pyproject.toml."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _words(doc: Documented, step: Step, names: Dict[str, str]) -> List[str]:
    """The command's words as the shell gives them to the program, with the step's changes."""
    text = doc.text
    for name, value in sorted(doc.variables, key=lambda kv: -len(kv[0])):
        text = text.replace(f"${name}", value)
    words = [step.subs[w].format(**names) if w in step.subs else w for w in shlex.split(text)]
    return words + list(step.extra)


def _installed(program: str) -> bool:
    """Whether this environment's console script ``program`` runs the entry point pyproject.toml names (an install
    that predates the checkout's pyproject.toml may have another, or no such script)."""
    path = os.path.join(BIN, program)
    if not os.path.isfile(path):
        return False
    module, function = _scripts()[program].split(":")
    with open(path, errors="replace") as f:
        return f"from {module} import {function}\n" in f.read()


def _argv(words: List[str]) -> List[str]:
    """The process to start: console scripts and torchrun from this environment (a console script whose install
    predates pyproject.toml's entry point: that entry point, called as the script would call it), python as this
    interpreter, linvision/tools/ files of this checkout."""
    program, *args = words
    args = [os.path.join(ROOT, a) if a.startswith("linvision/tools/") else a for a in args]
    if program in ("python", "python3"):
        return [sys.executable, *args]
    if program in _scripts() and not _installed(program):
        return [*command_argv(program), *args]
    return [os.path.join(BIN, program), *args]


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _in_process(words: List[str], folder: str, monkeypatch) -> subprocess.CompletedProcess:
    """A console script run through its entry point in this process, in ``folder``."""
    entry = _scripts()[words[0]]
    module, function = entry.split(":")
    out, err = io.StringIO(), io.StringIO()
    import torch
    threads = torch.get_num_threads()
    with monkeypatch.context() as m:
        m.chdir(folder)
        m.setattr(sys, "argv", words)
        code = 0
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                getattr(importlib.import_module(module), function)()
        except SystemExit as e:
            code = e.code or 0
        finally:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(words, code, out.getvalue(), err.getvalue())


def _run(doc: Documented, step: Step, chain: Chain, folder: str, names, monkeypatch):
    words = _words(doc, step, names)
    if chain.slow:
        proc = subprocess.run(_argv(words), cwd=folder, env=_clean_env(), capture_output=True, text=True,
                              timeout=chain.timeout)
    else:
        proc = _in_process(words, folder, monkeypatch)
    where = f"{doc.page}:{doc.line}: `{' '.join(words)}`"
    if doc.output:  # a "$ " line: what the page prints is what it prints
        _refused_as_printed(doc.output)(folder, proc)
    else:
        assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if step.check is not None:
        step.check(folder, proc)


# --- the tests ----------------------------------------------------------------------------------------------------

DOCUMENTED = documented_commands()


def _by_text():
    by_text: Dict[str, List[Documented]] = {}
    for doc in DOCUMENTED:
        by_text.setdefault(doc.text, []).append(doc)
    return by_text


def test_every_documented_command_is_run_or_skipped():
    """A command a page shows is run by a chain or skipped with a reason, not both; every entry is still shown by a
    page; every change to a printed line says why."""
    shown = _by_text()
    run = [step.command for chain in CHAINS.values() for step in chain.steps]
    assert len(run) == len(set(run)), "a command in two chains"
    missing = [f"{d.page}:{d.line}: {d.text}" for text, docs in shown.items() if text not in run
               and text not in SKIPPED for d in docs[:1]]
    assert not missing, "commands of the pages neither run (CHAINS) nor skipped (SKIPPED):\n" + "\n".join(missing)
    assert not set(run) & set(SKIPPED), set(run) & set(SKIPPED)
    stale = [text for text in [*run, *SKIPPED] if text not in shown]
    assert not stale, f"entries no page shows (any more): {stale}"
    for chain in CHAINS.values():
        for step in chain.steps:
            assert bool(step.extra or step.subs) == bool(step.why), f"{step.command}: a change without its reason"
    assert all(reason for reason in SKIPPED.values())
    assert len(shown) >= 70 and any(not chain.slow for chain in CHAINS.values())


def test_commands_are_read_as_a_reader_reads_them():
    """Continuation lines, comments, variables, a session's output, Python in an unmarked block, and any line of
    a bash block."""
    page = "\n".join([
        "```bash",
        "linvision-train --config a \\",
        "    --epochs 3   # a comment",
        "# only a comment",
        'V="--model m --model-kwargs x=1"',
        "linvision-train $V y=2",
        "git clone somewhere",
        "```",
        "```",
        "$ linvision-train --img-size 100",
        "error: img_size: cannot run at 100 px (a",
        "wrapped line)",
        "```",
        "```",
        "import torch",
        "python linvision/tools/export.py --model m   # run from the checkout",
        "```",
        "```python",
        "linvision-train --never-a-command",
        "```",
    ])
    found = commands_of("p.md", page)
    assert [(d.line, d.text) for d in found] == [
        (2, "linvision-train --config a --epochs 3"), (6, "linvision-train $V y=2"), (7, "git clone somewhere"),
        (10, "linvision-train --img-size 100"), (16, "python linvision/tools/export.py --model m")]
    assert found[1].variables == (("V", "--model m --model-kwargs x=1"),)
    assert found[3].output == "error: img_size: cannot run at 100 px (a\nwrapped line)"
    step = Step("linvision-train $V y=2", subs={"m": "{folder}"}, extra=("--epochs", "1"), why="w")
    assert _words(found[1], step, {"folder": "/tmp/f"}) == [
        "linvision-train", "--model", "/tmp/f", "--model-kwargs", "x=1", "y=2", "--epochs", "1"]


def test_a_refusal_must_print_what_the_page_prints():
    page = "```\n$ linvision-train --img-size 100\nerror: img_size: 100 px\n```\n"
    (doc,) = commands_of("p.md", page)
    printed = subprocess.CompletedProcess([], 2, "", "error: img_size: 100 px\n")
    _refused_as_printed(doc.output)(None, printed)
    for code, stderr in ((2, "error: img_size: 99 px\n"), (0, "error: img_size: 100 px\n")):
        with pytest.raises(AssertionError):
            _refused_as_printed(doc.output)(None, subprocess.CompletedProcess([], code, "", stderr))


def _chain_params():
    return [pytest.param(name, id=name, marks=([pytest.mark.slow] if chain.slow else [])
                         + ([pytest.mark.xfail(strict=True, reason=chain.fails)] if chain.fails else []))
            for name, chain in CHAINS.items()]


@pytest.mark.parametrize("name", _chain_params())
def test_documented_commands_run(name, tmp_path, monkeypatch):
    """The chain's commands run in order in one empty folder, as printed but for the changes of their steps, and
    do what their checks say (a documented error: exit status 2 and the page's message)."""
    chain = CHAINS[name]
    shown = _by_text()
    names = chain.setup(str(tmp_path)) if chain.setup else {}
    for step in chain.steps:
        _run(shown[step.command][0], step, chain, str(tmp_path), names, monkeypatch)
