"""The Python examples of README.md and of the manual (docs/**/*.md) run as printed, each in a fresh namespace and
an empty folder.

Examples that need a GPU are skipped without one; those that load a run folder ("output/...") need a training
command first, and those that name a hub tag download weights: all three are skipped, saying which, and what they
call is checked by the kernel, tool and model tests instead."""
import glob
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                          recursive=True))


def _examples():
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        found += [(page, text[:m.start()].count("\n") + 2, m.group(1))
                  for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]
    return found


EXAMPLES = _examples()


def test_pages_have_examples():
    pages = {page for page, _, _ in EXAMPLES}
    assert "README.md" in pages and len(pages) >= 6, pages
    assert len(EXAMPLES) >= 12


def skip_reason(code: str):
    if '"cuda"' in code and not torch.cuda.is_available():
        return "needs a GPU"
    if '"output/' in code:
        return "needs a trained run folder (the training command of the same page)"
    if re.search(r'create_model\("[^"]+\.[^"]+", pretrained=True', code):
        return "downloads pretrained weights from the hub"
    return None


@pytest.mark.parametrize("page, line, code", EXAMPLES, ids=[f"{page}:{line}" for page, line, _ in EXAMPLES])
def test_example_runs(page, line, code, tmp_path, monkeypatch):
    reason = skip_reason(code)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "example"})
