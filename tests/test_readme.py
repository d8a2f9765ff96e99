"""The Python examples in README.md run as printed, each in a fresh namespace and an empty folder.

Examples that need a GPU are skipped without one; the one that loads a run folder ("output/...") needs the
README's training command first and the one that names a hub tag downloads weights: both are checked by the
tool and model tests instead."""
import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _examples():
    with open(README) as f:
        text = f.read()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


EXAMPLES = _examples()


def test_readme_has_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("line, code", EXAMPLES, ids=[f"line{line}" for line, _ in EXAMPLES])
def test_readme_example_runs(line, code, tmp_path, monkeypatch):
    if '"cuda"' in code and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if '"output/' in code:
        pytest.skip("needs a trained run folder (README's training command)")
    if re.search(r'create_model\("[^"]+\.[^"]+", pretrained=True', code):
        pytest.skip("downloads pretrained weights from the hub")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme"})
