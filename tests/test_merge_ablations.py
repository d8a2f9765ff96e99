"""linvision-ablate --merge: ablations run one seed each, joined into the table one ablation of all the seeds gives."""
import json
import statistics

import pytest

from linvision.experiments.merge_ablations import merge_ablations
from support import run_tool, tiny_ablate_flags, write_ablation_json

LEPE = '{"depths": [1, 1, 1, 1], "dims": [8, 16, 16, 16], "num_heads": [1, 1, 1, 1], "mixer_kwargs": {"lepe": true}}'


def test_ablations_of_one_seed_each_merge_into_the_ablation_of_both_seeds(data, tmp_path):
    """Seeds 3 and 5 of `linear` trained in two ablations and merged give the per-seed values, mean and spread of
    one ablation that trained both; a third ablation with other model options (LePE) stays a row of its own,
    labelled with the option. The table gives each row its seeds and no throughput; the tool prints it."""
    run_tool("ablate.py", *tiny_ablate_flags(data, tmp_path / "both", "--mixers", "linear", "--seeds", "3", "5"))
    for seed in (3, 5):
        run_tool("ablate.py", *tiny_ablate_flags(data, tmp_path / f"s{seed}", "--mixers", "linear", "--seeds",
                                                 str(seed)))
    flags = tiny_ablate_flags(data, tmp_path / "lepe", "--mixers", "linear", "--seeds", "3")
    flags[flags.index("--model-kwargs") + 1] = LEPE
    run_tool("ablate.py", *flags)
    folders = [str(tmp_path / f / "ab") for f in ("s3", "s5", "lepe")]
    printed = run_tool("ablate.py", "--merge", *folders, "--output", str(tmp_path), "--experiment", "merged").stdout

    both = json.loads((tmp_path / "both" / "ab" / "ablation.json").read_text())["rows"][0]
    merged = json.loads((tmp_path / "merged" / "ablation.json").read_text())
    plain, lepe = merged["rows"]
    assert plain["mixer"] == "linear" and lepe["mixer"] == "linear (mixer_kwargs.lepe=True)"
    tops = both["accuracy_seeds"]["32"]
    assert plain["accuracy_seeds"]["32"] == tops  # the same trainings, seed for seed
    assert plain["accuracy"]["32"] == pytest.approx(statistics.mean(tops), rel=1e-12)
    assert plain["accuracy_std"]["32"] == pytest.approx(statistics.stdev(tops), rel=1e-12)
    assert [(r["seed"], r["ablation"]) for r in plain["runs"]] == [(3, folders[0]), (5, folders[1])]
    one = json.loads((tmp_path / "lepe" / "ab" / "ablation.json").read_text())["rows"][0]
    assert lepe["accuracy_seeds"]["32"] == one["accuracy_seeds"]["32"] and lepe["accuracy_std"]["32"] == 0.0
    assert lepe["params_m"] > plain["params_m"]  # LePE's depthwise convolutions
    assert merged["model_kwargs"] == {"depths": [1, 1, 1, 1], "dims": [8, 16, 16, 16], "num_heads": [1, 1, 1, 1]}
    assert merged["seeds"] == [3, 5] and merged["bench_sizes"] == [] and merged["merged_from"] == folders

    table = (tmp_path / "merged" / "ablation.md").read_text()
    mean, std = statistics.mean(tops), statistics.stdev(tops)
    assert f"| linear | 3, 5 | {plain['params_m']:.3f} | {plain['gflops']:.4f} | {mean:.2f} ± {std:.2f} |" in table
    assert f"| linear (mixer_kwargs.lepe=True) | 3 | {lepe['params_m']:.3f} |" in table
    assert f"| {one['accuracy']['32']:.2f} |\n" in table  # one seed: no spread
    assert "img/s" not in table and "No throughput or memory" in table
    assert "over each row's seeds" in table
    assert table in printed and (tmp_path / "merged" / "accuracy.png").stat().st_size > 10_000


def test_merge_refuses_what_is_not_one_ablation_in_one_line(tmp_path):
    a = write_ablation_json(tmp_path / "a", seeds=(0, 1))
    with pytest.raises(ValueError, match=r"^merge: give two or more ablation folders, got 1$"):
        merge_ablations([a])
    with pytest.raises(ValueError, match=r"merge: .*empty holds no ablation.json; give folders linvision-ablate"):
        merge_ablations([a, str(tmp_path / "empty")])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "ablation.json").write_text("{\"rows\": [")
    with pytest.raises(ValueError, match=r"merge: cannot read .*bad/ablation.json"):
        merge_ablations([a, str(tmp_path / "bad")])
    other = write_ablation_json(tmp_path / "other", seeds=(2,), img_size=48)
    with pytest.raises(ValueError, match=r"merge: .*other is an ablation with img_size=48; .*a has img_size=32 "
                                         r"\(only ablations of one task"):
        merge_ablations([a, other])
    head = write_ablation_json(tmp_path / "head", seeds=(2,), task="segment", decoder="fpn")
    with pytest.raises(ValueError, match=r"with task='segment', decoder='fpn'; .*a has task='classify', decoder=None"):
        merge_ablations([a, head])
    again = write_ablation_json(tmp_path / "again", seeds=(1, 2))
    with pytest.raises(ValueError, match=r"merge: seed 1 of linear is in .*a and in .*again; give each run once"):
        merge_ablations([a, again])
    # a seed of another mixer, or of other options, is another row: no clash
    soft = write_ablation_json(tmp_path / "soft", seeds=(1,), mixer="softmax")
    big = write_ablation_json(tmp_path / "big", seeds=(1,), model_kwargs={"dims": 4})
    assert [r["mixer"] for r in merge_ablations([a, soft, big])["rows"]] == ["linear", "softmax", "linear (dims=4)"]
    proc = run_tool("ablate.py", "--merge", a, again, "--resume", a, check=False)
    assert proc.returncode != 0 and "--merge trains nothing and --resume goes on training" in proc.stderr


def test_merged_folder_is_never_written_over_without_overwrite(tmp_path):
    folders = [write_ablation_json(tmp_path / "a", seeds=(0,)), write_ablation_json(tmp_path / "b", seeds=(1,))]
    first = run_tool("ablate.py", "--merge", *folders, "--output", str(tmp_path), "--experiment", "m").stdout
    second = run_tool("ablate.py", "--merge", *folders, "--output", str(tmp_path), "--experiment", "m").stdout
    assert f"table and plot in {tmp_path / 'm'}\n" in first and f"table and plot in {tmp_path / 'm-1'}\n" in second
    assert "| linear | 1.000 | 0.5000 | 50.50 ± 0.71 |" in first  # mean of 50 and 51, sample s.d. 0.7071; one seed set
