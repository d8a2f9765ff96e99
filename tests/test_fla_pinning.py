"""fla-core's autotuned kernels pinned to one configuration each (linvision/ops/recurrent/kernels.py): the rule per
architecture and head size, the choice among fla's own configurations, every autotuner of the recurrences' fla
modules pinned on the first kernel call (one configuration compiled, none timed), the ways to keep fla's autotuning,
and the pinned configurations compiled for sm_90 (slow)."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

triton = pytest.importorskip("triton")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla says once that it found no GPU
    pytest.importorskip("fla.ops.delta_rule", reason="fla-core is not installed (pip install 'linvision[kernels]')")

from linvision.ops.recurrent import kernels as rk  # noqa: E402


def test_the_rule_per_architecture_and_head_size():
    assert rk.pin_rule(9, 64) == {"num_warps": 4, "num_stages": 3, "block": 64}
    assert rk.pin_rule(9, 128) == {"num_warps": 4, "num_stages": 3, "block": 64}
    assert rk.pin_rule(8, 32) == {"num_warps": 4, "num_stages": 2, "block": 32}
    assert rk.pin_rule(None, 16) == {"num_warps": 4, "num_stages": 2, "block": 16}
    assert rk.pin_rule(9, 8)["block"] == 16
    assert rk.pin_rule(9, 64, "chunk_gla_bwd_kernel_inter")["num_warps"] == 8


def test_the_nearest_of_the_offered_configurations_is_kept():
    C = triton.Config
    configs = [C({"BK": bk, "BV": bv}, num_warps=w, num_stages=s) for bk in (16, 32, 64) for bv in (32, 128)
               for w in (2, 4, 8) for s in (2, 3)]
    picked = rk.pick_config(configs, {"K": 64, "V": 64}, 9)
    assert (picked.kwargs, picked.num_warps, picked.num_stages) == ({"BK": 64, "BV": 32}, 4, 3)
    picked = rk.pick_config(configs, {"K": 32}, 8)  # V unknown: blocks against D's cap, stages before Hopper
    assert (picked.kwargs, picked.num_warps, picked.num_stages) == ({"BK": 32, "BV": 32}, 4, 2)
    picked = rk.pick_config(configs, {"D": 16}, 9, "chunk_gla_bwd_kernel_dv")  # over the cap costs more than under
    assert (picked.kwargs, picked.num_warps) == ({"BK": 16, "BV": 32}, 8)
    only = [C({}, num_warps=2, num_stages=1), C({}, num_warps=2, num_stages=2)]
    assert rk.pick_config(only, {}, 9) is only[1]  # fla offers 2 warps only: the stages decide, ties to the first


def test_every_autotuner_of_the_recurrences_is_pinned_on_the_first_kernel_call(monkeypatch):
    """After fla's kernels are imported for a call, each autotuner of the modules the recurrences use keeps one of
    its own configurations per launch (so Triton times none), whatever the head size."""
    monkeypatch.delenv(rk.AUTOTUNE_ENV, raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert rk._import_reason() is None
    rk.pin_configs()
    tuners = rk.fla_autotuners()
    names = {rk.kernel_name(t) for t in tuners}
    assert {"chunk_scaled_dot_kkt_fwd_kernel", "prepare_wy_repr_bwd_kernel", "chunk_gla_bwd_kernel_inter",
            "chunk_fwd_kernel_o", "chunk_local_cumsum_scalar_kernel", "l2norm_fwd_kernel"} <= names
    for tuner in tuners:
        assert getattr(tuner.early_config_prune, "pinned", False), rk.kernel_name(tuner)
        for d in (32, 64, 128):
            kept = tuner.early_config_prune(tuner.configs, {"K": d, "V": d, "D": d, "BT": 64})
            assert len(kept) == 1 and kept[0] in tuner.configs, (rk.kernel_name(tuner), d)
    assert rk.pin_configs() == 0  # once per autotuner


def test_fla_autotuning_is_kept_on_request():
    """LINVISION_FLA_AUTOTUNE=1, or fla's own cache of tuned configurations turned on, leaves fla's autotuners as
    they are (each in a fresh process, before the first kernel call; the two run side by side, as each spends
    most of its time importing fla)."""
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from linvision.ops.recurrent import kernels as rk\n"
            "assert rk._import_reason() is None\n"
            "print(len(rk.fla_autotuners()), sum(getattr(t.early_config_prune, 'pinned', False) "
            "for t in rk.fla_autotuners()))")
    envs = [{rk.AUTOTUNE_ENV: "1"}, {"FLA_CACHE_MODE": "strict"}]
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1", **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for env, proc, (out, err) in zip(envs, procs, outputs):
        assert proc.returncode == 0, (env, err[-2000:])
        found, pinned = map(int, out.split())
        assert found >= 20 and pinned == 0, env


SM90 = textwrap.dedent("""
    import json, sys
    from linvision.kernels import compile_check as ck
    ck.pretend_hopper()
    import torch
    from linvision.ops.recurrent import kernels as rk
    from linvision.ops.recurrent.scan import Reversal
    d, n, rows = int(sys.argv[1]), 1024, []
    for form in ("delta", "head", "channel"):
        ck._FLA_COMPILED.clear()
        q, k, v = (torch.rand(1, 2, n, d, requires_grad=True) for _ in range(3))
        if form == "delta":
            o = rk.bidirectional_delta(q, k, v, torch.rand(1, 2, n, requires_grad=True), dtype=torch.bfloat16,
                                       flip=Reversal(None, n))
        else:
            g = torch.full((1, 2, n, 1 if form == "head" else d), -0.01, requires_grad=True)
            o = rk.bidirectional_gated(q, k, v, g, dtype=torch.bfloat16, normalize=True, eps=1e-4,
                                       flip=Reversal(None, n))
        o.float().sum().backward()
        for name, kernel in ck._FLA_COMPILED:
            rows.append([form, name, *ck.ptxas_usage(kernel.asm["ptx"]), kernel.metadata.shared])
    print(json.dumps(rows))
""")


@pytest.mark.slow
@pytest.mark.parametrize("d", [32, 64, 128])
def test_pinned_configurations_compile_for_hopper(d):
    """The bidirectional delta rule and both gated forms, forward and backward, bf16, compiled for sm_90 without a
    GPU (linvision-check-kernels' pretend H100): one configuration per kernel and launch, each within a block's
    227 KB of shared memory; register spills only where fla's Hopper list leaves no choice
    (prepare_wy_repr_bwd_kernel, 2 warps), the per-channel gate's dv backward at D = 32 and a few bytes of the delta
    rule's state backward at D = 128 (the table of docs/kernels.md)."""
    import json

    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SM90, str(d)], env=env, capture_output=True, text=True,
                            timeout=3000)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(result.stdout.splitlines()[-1])
    assert {r[1] for r in rows} >= {"chunk_scaled_dot_kkt_fwd_kernel", "chunk_gla_bwd_kernel_inter",
                                    "chunk_bwd_kernel_dh", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"}
    assert all(shared <= 232448 for *_, shared in rows)
    spilling = {(form, name) for form, name, _, spill, _ in rows if spill}
    allowed = {("delta", "prepare_wy_repr_bwd_kernel")}
    allowed |= {32: {("channel", "chunk_gla_bwd_kernel_dv")}, 64: set(),
                128: {("delta", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64")}}[d]
    assert spilling <= allowed, spilling
