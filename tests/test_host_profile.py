"""linvision.benchmark.host_profile: the per-call figures of a call read with torch.profiler, on the CPU."""
import pytest
import torch

from linvision.benchmark.host_profile import profile_call


def test_counts_each_operator_per_call():
    x = torch.ones(8, 8)

    def three_adds_and_a_mul():
        return ((x + 1) + 2 + 3) * 2

    r = profile_call(three_adds_and_a_mul, "cpu", steps=3, warmup=1, top=20)
    calls = {row["op"]: row["calls"] for row in r["top"]}
    assert calls["aten::add"] == 3 and calls["aten::mul"] == 1
    assert r["aten_ops"] >= 4
    assert r["launches"] == 0 and r["device_ms"] == 0 and r["kernels"] == []  # nothing is launched on a CPU
    assert r["wall_ms"] >= r["host_ms"] > 0
    assert all(row["self_host_us"] >= 0 for row in r["top"])


def test_top_is_sorted_by_host_time_and_limited():
    x = torch.ones(4)
    r = profile_call(lambda: (x + 1).relu().sum(), "cpu", steps=2, warmup=0, top=2)
    assert len(r["top"]) == 2
    assert r["top"][0]["self_host_us"] >= r["top"][1]["self_host_us"]


@pytest.mark.parametrize("steps, warmup", [(0, 1), (2, -1)])
def test_refuses_bad_counts(steps, warmup):
    with pytest.raises(ValueError, match="steps"):
        profile_call(lambda: None, "cpu", steps=steps, warmup=warmup)
