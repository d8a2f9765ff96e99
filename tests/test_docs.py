"""The manual builds as `make docs` builds it, with every warning an error (broken links and anchors, docstrings
the API reference cannot read, generated tables that cannot be made), and what it generates is complete."""
import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _text(site, page: str) -> str:
    with open(os.path.join(site, page)) as f:
        return f.read()


def _scripts() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def test_every_command_and_flag_is_in_the_manual(site):
    html = _text(site, "tools.html")
    for command, target in _scripts().items():
        parser = importlib.import_module(target.split(":")[0]).build_parser()
        assert f'id="{command}"' in html, f"tools page has no section for {command}"
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"<code>{flag}</code>" in html, f"{command}: flag {flag} missing from the tools page"


def test_api_reference_and_model_cards_are_built(site):
    api = _text(site, "api/ops.html")
    assert 'id="linvision.ops.linear_attention.linear_attention"' in api
    cards = _text(site, "models/published.html")
    for name in ("mlla_tiny", "ravlt_large"):
        assert f"<code>{name}</code>" in cards
    assert "Demystify Mamba in Vision" in cards and "arXiv:2411.07635" in cards


def test_build_fails_on_a_broken_link(tmp_path):
    """The strict build is what catches rot: a page with a dead link must fail it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# t\n\n[gone](missing.md) and [no anchor](#nowhere)\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: t\nstrict: true\nvalidation:\n  anchors: warn\n")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path, capture_output=True,
                          text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), timeout=300)
    assert proc.returncode != 0
    assert "missing.md" in proc.stderr and "nowhere" in proc.stderr


def test_flag_marker_for_an_unknown_command_fails():
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "hooks.py"))
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    with pytest.raises(ValueError, match="linvision-nope"):
        hooks.on_page_markdown("<!-- flags: linvision-nope -->\n", None, None, None)
    table = hooks.on_page_markdown("<!-- flags: linvision-validate -->\n", None, None, None)
    assert re.search(r"^\| `--checkpoint` \|", table, re.M) and "linvision-validate --help" in table


MODELS_JSON = os.path.join(ROOT, "docs", "models.json")


def _model_table():
    from linvision.tools import model_table
    return model_table


def test_stored_model_table_covers_every_model_and_is_readme_s():
    import timm
    mt = _model_table()
    rows = mt.read_rows(MODELS_JSON)
    assert [r["model"] for r in rows] == timm.list_models(list(mt.DEFAULT_FILTER))
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert mt.front_table(rows) in readme, "README's model table differs from `linvision-model-table " \
                                           "--from-json docs/models.json --style front`"
    assert f"`{mt.COMMAND}`" in readme


def _check_fresh(names):
    mt = _model_table()
    stored = {r["model"]: r for r in mt.read_rows(MODELS_JSON)}
    for fresh in mt.measure(names):
        assert fresh == stored[fresh["model"]], f"docs/models.json is stale; re-run `{mt.COMMAND}`"


def test_stored_model_table_matches_a_fresh_count_for_every_model():
    """Every model is built and counted again (about 25 s on 2 cores): a change to a model shows here."""
    import timm
    _check_fresh(timm.list_models(list(_model_table().DEFAULT_FILTER)))


def test_model_table_refuses_a_damaged_file(tmp_path):
    bad = tmp_path / "models.json"
    bad.write_text('{"models": [{"model": "x"}]')
    with pytest.raises(ValueError, match="models.json: not a model table"):
        _model_table().read_rows(str(bad))
    bad.write_text('{"models": [{"model": "x"}]}')
    with pytest.raises(ValueError, match="mixers"):
        _model_table().read_rows(str(bad))


def test_every_list_and_table_renders(site):
    """Markdown that GitHub renders but the site's Markdown would print as text: a list without a blank line before
    it, a table inside an HTML block without markdown="1"."""
    import glob
    for path in glob.glob(os.path.join(site, "**", "*.html"), recursive=True):
        if os.sep + "api" + os.sep in path:
            continue
        html = _text(site, path)
        page = os.path.relpath(path, site)
        assert "|---" not in html, f"{page}: a Markdown table printed as text"
        assert not re.search(r"<p>[^<]*\n(- |\d+\. )", html), f"{page}: a list printed as a paragraph"
