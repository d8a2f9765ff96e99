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
from support import command_parser

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
    for command in _scripts():
        parser = command_parser(command)
        assert f'id="{command}"' in html, f"tools page has no section for {command}"
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"<code>{flag}</code>" in html, f"{command}: flag {flag} missing from the tools page"


def test_api_reference_and_model_cards_are_built(site):
    api = _text(site, "api/ops.html")
    assert 'id="linvision.ops.attention.dispatch.linear_attention"' in api
    cards = _text(site, "models/published.html")
    for name in ("mlla_tiny", "ravlt_large", "mavit_small"):
        assert f"<code>{name}</code>" in cards
    assert "Demystify Mamba in Vision" in cards and "arXiv:2411.07635" in cards and "arXiv:2507.00698" in cards
    assert "<code>inline_deit_base</code>" in cards and "arXiv:2412.06590" in cards


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
    from linvision.benchmark import model_table
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


def test_front_table_rows_are_short_and_name_what_the_top1_belongs_to():
    """README's row per family stays readable: linvit's ten models in one brace pattern (every name it stands
    for registered, none left out), the models with a fixed size named by their variant, and a published top-1
    known for only some of a family's models (MAViT's small) says whose it is."""
    import itertools
    import re

    import timm
    mt = _model_table()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in mt.front_table(mt.read_rows(MODELS_JSON)).splitlines()}
    assert rows["MAViT"].endswith("| 84.7 (small) |") and rows["MLLA"].endswith("| 83.5-85.3 |")
    linvit = rows["linvit"].split(" | ")
    pattern, *others = re.findall(r"`([^`]+)`", linvit[1])
    groups = re.findall(r"\{([^}]*)\}", pattern)
    pieces = re.split(r"\{[^}]*\}", pattern)
    named = {"".join(itertools.chain.from_iterable(zip(pieces, choice))) + pieces[-1]
             for choice in itertools.product(*(g.split(",") for g in groups))} | set(others)
    assert named == set(timm.list_models("linvit_*")) and len(linvit[1]) < 100
    assert linvit[3] == ("any multiple of 16; `*_patch16_224`, `*_patch16_pola_224`: 224 px "
                         "(`dynamic_img_size=True`: any multiple of 16)")


def test_readme_is_short_and_says_where_things_live():
    """At most 150 lines; it says where the kernels, configs and tools are (inside linvision/), how the tools take
    their threads, and its CPU headline points at the CPU plot of the measured comparisons, not at the GPU figure
    above it."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert readme.count("\n") <= 150
    for where in ("`linvision/kernels/`", "`linvision/configs/`", "`linvision/tools/`"):
        assert where in readme
    assert "`--threads N`, else `OMP_NUM_THREADS`, else the cores other processes leave free" in " ".join(readme.split())
    assert "(the plot above)" not in readme
    assert "(docs/results.md#linear-attention-against-its-softmax-twin-as-the-resolution-grows)" in readme
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        assert "## Linear attention against its softmax twin as the resolution grows" in f.read()


def _check_fresh(names):
    mt = _model_table()
    stored = {r["model"]: r for r in mt.read_rows(MODELS_JSON)}
    for fresh in mt.measure(names):
        assert fresh == stored[fresh["model"]], f"docs/models.json is stale; re-run `{mt.COMMAND}`"


def test_stored_model_table_matches_a_fresh_count_for_each_family():
    """The smallest model of each family is built and counted again, on the meta device as the tool counts: a
    change to a family's code shows here (every model: the slow test below)."""
    import timm
    names = [r["model"] for r in _smallest_of_each_family()]
    assert len(names) >= 14 and set(names) <= set(timm.list_models(list(_model_table().DEFAULT_FILTER)))
    _check_fresh(names)


@pytest.mark.slow
def test_stored_model_table_matches_a_fresh_count_for_every_model():
    """Every model is built and counted again (about 80 s on 2 busy cores): a change to one size shows here."""
    import timm
    _check_fresh(timm.list_models(list(_model_table().DEFAULT_FILTER)))


def test_meta_counts_are_a_cpu_run_s():
    """The table counts on the meta device (shapes, no weights): its params, GFLOPs and input claims are those of
    the same models built and run on the CPU (softmax SDPA and RALA with RoPE; the delta rule's chunked scans; a
    fixed-size ViT's refusal)."""
    import timm
    import torch
    from linvision.benchmark.flops import count_gflops_split, count_params

    for name in ("ravlt_tiny", "linhier_delta_femto_224"):
        torch.manual_seed(0)
        cpu = timm.create_model(name)
        with torch.device("meta"):
            meta = timm.create_model(name)
        assert next(meta.parameters()).is_meta and not next(cpu.parameters()).is_meta
        assert count_params(meta) == count_params(cpu)
        assert count_gflops_split(meta, 96) == count_gflops_split(cpu, 96), name
    for name, multiple in (("ravlt_tiny", 32), ("linvit_tiny_patch16_224", None)):
        assert _model_table().input_multiple(name) == _model_table().input_multiple(name, device="cpu") == multiple


def _smallest_of_each_family():
    mt = _model_table()
    smallest = {}
    for r in mt.read_rows(MODELS_JSON):
        label = mt.family(r["model"])
        if label not in smallest or r["params_m"] < smallest[label]["params_m"]:
            smallest[label] = r
    return sorted(smallest.values(), key=lambda r: r["model"])


@pytest.mark.parametrize("row", _smallest_of_each_family(), ids=lambda r: r["model"])
def test_the_input_each_family_claims_holds_by_default(row):
    """The input column of README's table and the manual's (``input_multiple`` of docs/models.json) holds for
    ``timm.create_model(name)`` with no other argument, at sizes other than those the table was made with: a model
    claimed to take any multiple of m runs at 4m x 3m and 5m x 2m with logits of its classes; one claimed to take
    its own size only refuses another (the claim then names ``dynamic_img_size=True``, which lifts it)."""
    import timm
    import torch

    torch.manual_seed(0)
    name = row["model"]
    model = timm.create_model(name).eval()
    m = row["input_multiple"]
    with torch.no_grad():
        if m:
            for h, w in ((4 * m, 3 * m), (5 * m, 2 * m)):
                assert model(torch.randn(1, 3, h, w)).shape == (1, model.num_classes), (name, h, w)
            assert f"any multiple of {m}" in _model_table().input_text(row)
        else:
            with pytest.raises(ValueError, match=r"^x: this model takes 224x224 images"):
                model(torch.randn(1, 3, 64, 96))
            assert "`dynamic_img_size=True`: any multiple of 16" in _model_table().input_text(row)
            dynamic = timm.create_model(name, dynamic_img_size=True).eval()
            assert dynamic(torch.randn(1, 3, 64, 96)).shape == (1, dynamic.num_classes)


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


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "hooks.py"))
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def _pages(site):
    """Relative path -> HTML of every page of the manual (the API reference and the 404 page left out)."""
    import glob
    pages = {}
    for path in glob.glob(os.path.join(site, "**", "*.html"), recursive=True):
        page = os.path.relpath(path, site)
        if not page.startswith("api" + os.sep) and page != "404.html":
            pages[page] = _text(site, page)
    return pages


def _markdown_of(page: str) -> str:
    with open(os.path.join(ROOT, "docs", page[:-len(".html")] + ".md")) as f:
        return f.read()


def test_placeholders_in_generated_cells_print_as_written(site):
    """``<name>`` in a flag's help is text, not an unknown HTML tag that the browser drops."""
    html = _text(site, "tools.html")
    row = re.search(r"<td><code>--dataset</code></td>\s*<td><code>folder</code></td>\s*<td>([^\n]*?)</td>", html)
    assert row, "tools page: no --dataset row of linvision-train"
    assert "'torch/&lt;name&gt;' (timm's spelling, e.g. torch/cifar10) or 'torchvision/&lt;Name&gt;'" in row.group(1)
    assert "default: benchmark-&lt;time&gt;" in html
    assert "<name>" not in html and "<time>" not in html
    escape = _hooks()._escape
    assert escape("a <b> & `c <d>` e>") == "a &lt;b&gt; &amp; `c <d>` e&gt;"


def test_usage_blocks_fit_the_page():
    """The printed usage of every command wraps at the hooks' width, long lists of choices named by the flag."""
    hooks = _hooks()
    for command in _scripts():
        usage = hooks.flags_table(command).split("```")[1]
        assert max(map(len, usage.splitlines())) <= hooks.USAGE_WIDTH, command
    assert "[--kernel KERNEL [KERNEL ...]]" in hooks.flags_table("linvision-check-kernels")


def test_names_in_table_cells_are_not_split(site):
    """A flag or a name in a table cell stays on one line (the browser would otherwise break `--model` after its
    `--` or `--no-train` after `--no-`): the site's stylesheet keeps code in table cells from wrapping, and a
    flag table holds one code element per flag, so the cell still wraps between a flag and its alias."""
    css = _text(site, "stylesheets/extra.css")
    rules = {selector.strip(): body for selector, body in re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(
        r"/\*.*?\*/", "", css, flags=re.S))}
    assert "white-space: nowrap" in rules[".md-typeset table:not([class]) td code"]
    tools = _text(site, "tools.html")
    assert "<td><code>--models</code>, <code>--model</code></td>" in tools
    assert "<td><code>--train</code>, <code>--no-train</code></td>" in tools


def test_spreads_stay_whole_and_long_code_lines_wrap(site):
    """A "mean ± spread" cell of a results table is one unbroken run (the segmentation table broke each over three
    lines), the results page opens with its summary table, and a code line longer than the column wraps (the
    stylesheet's rule for every code block) instead of running past the right edge."""
    results = _text(site, "results.html")
    assert "<td>45.38&nbsp;\u00b1&nbsp;2.06</td>" in results
    assert not re.search(r"<td>[^<]* \u00b1 [^<]*</td>", results)
    assert results.index("The page at a glance") < results.index("Every figure on this page")
    css = re.sub(r"/\*.*?\*/", "", _text(site, "stylesheets/extra.css"), flags=re.S)
    rules = {selector.strip(): body for selector, body in re.findall(r"([^{}]+)\{([^}]*)\}", css)}
    assert "white-space: pre-wrap" in rules[".md-typeset pre > code"]


CODE_WIDTH = 104  # characters of a code line that fit the content column of a 1400 px window (docs/stylesheets)


def test_code_lines_of_the_pages_fit_the_column():
    import glob
    for path in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True):
        inside = False
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.startswith("```"):
                    inside = not inside
                elif inside:
                    assert len(line.rstrip("\n")) <= CODE_WIDTH, \
                        f"{os.path.relpath(path, ROOT)}:{number}: a code line of {len(line.rstrip())} characters"


def test_no_raw_rest_role_in_the_site(site):
    """The docstrings' :func:`x` and the like are links (or code), never printed as written."""
    import glob
    role = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj):")
    for path in glob.glob(os.path.join(site, "**", "*.html"), recursive=True):
        assert not role.search(_text(site, path)), f"{os.path.relpath(path, site)}: a raw reST role"
    ops = _text(site, "api/ops.html")
    links = re.findall(r'<a class="autorefs autorefs-internal"[^>]* href="([^"]*)"><code>([^<]*)</code></a>', ops)
    assert ("#linvision.ops.attention.dispatch.linear_attention", "linear_attention()") in links
    assert ("#linvision.ops.rope.Rope", "Rope") in links
    assert len(links) >= 25
    # the kernels' module is documented under its source name: a role naming linvision.kernels links there
    assert 'href="kernels.html#linvision.kernels.common.RopeSpec"><code>RopeSpec</code></a>' in ops


def test_ops_reference_opens_with_linear_attention(site):
    ops = _text(site, "api/ops.html")
    order = [ops.index(f'id="linvision.ops.{name}"') for name in
             ("attention", "feature_maps", "rope", "recurrent", "attention_variants")]
    assert order == sorted(order)


def test_every_table_and_figure_of_the_pages_is_built(site):
    """Each page shows as many tables as its Markdown holds once the generated ones are in, and every figure."""
    hooks = _hooks()
    separator = re.compile(r"^\|(?:\s*:?-+:?\s*\|)+\s*$", re.M)
    for page, html in _pages(site).items():
        markdown = hooks.on_page_markdown(_markdown_of(page), None, None, None)
        assert html.count("<table>") == len(separator.findall(markdown)), f"{page}: tables"
        for src in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown):
            assert f'src="{src}"' in html, f"{page}: figure {src} missing"
            built = os.path.join(site, os.path.dirname(page), src)
            with open(built, "rb") as a, open(os.path.join(ROOT, "docs", os.path.dirname(page), src), "rb") as b:
                assert a.read() == b.read(), f"{page}: {src} differs from docs/"
    shown = len(re.findall(r"!\[[^\]]*\]\(figures/", _markdown_of("results.html")))
    assert shown >= 5 and _text(site, "results.html").count('src="figures/') == shown


def test_formulas_render_as_mathml(site):
    core = _text(site, "core-op.html")
    assert core.count("<math") >= 15
    assert '<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">' in core and "<mfrac>" in core
    assert "<math" in _text(site, "index.html")
    for page, html in _pages(site).items():
        assert 'class="arithmatex"' not in html and "\\frac" not in html and "\\phi" not in html, page
    hooks = _hooks()
    assert hooks.on_page_content('<p><span class="arithmatex">\\(a &lt; b\\)</span></p>', None, None, None) == \
        '<p><math xmlns="http://www.w3.org/1998/Math/MathML" display="inline"><mrow><mi>a</mi><mo>&#x0003C;</mo>' \
        '<mi>b</mi></mrow></math></p>'
    with pytest.raises(ValueError, match="cannot convert"):
        hooks.on_page_content('<span class="arithmatex">\\(\\left(\\)</span>', None, None, None)
    with pytest.raises(ValueError, match="does not know .*nosuchcommand"):
        hooks.on_page_content('<span class="arithmatex">\\(\\nosuchcommand x\\)</span>', None, None, None)


def test_search_works_from_the_files(site):
    """Opened from site/index.html (no server): the index is a script, every page loads the Worker stand-in
    before the theme's bundle, and nothing is fetched from the network."""
    import json
    with open(os.path.join(site, "search", "search_index.js")) as f:
        script = f.read()
    assert script.startswith("var __index = ")
    index = json.loads(script[len("var __index = "):])
    assert {"index.html", "core-op.html", "tools.html", "api/ops.html"} <= {d["location"] for d in index["docs"]}
    assert os.path.isfile(os.path.join(site, "javascripts", "iframe-worker.js"))
    for page, prefix in (("index.html", ""), ("models/index.html", "../"), ("api/ops.html", "../")):
        html = _text(site, page)
        shim = html.index(f'<script src="{prefix}javascripts/iframe-worker.js"></script>')
        assert shim < html.index(f'<script src="{prefix}assets/javascripts/bundle.')
        assert 'class="md-search__input"' in html
        assert not re.search(r'(src|href)="https?://(fonts|unpkg)', html), page


def test_home_page_starts_with_the_quickstart(site):
    import html as html_module
    page = _text(site, "index.html")
    start, end = page.index('id="quickstart"'), page.index('id="the-manual"')
    quickstart = html_module.unescape(re.sub(r"<[^>]+>", "", page[start:end]))
    for command in ("pip install .", "import timm, linvision",
                    'model = timm.create_model("mlla_tiny.in1k", pretrained=True).eval()',
                    "linvision-train --config finetune_mlla_tiny --data-dir /data/pets",
                    "linvision-train --model mlla_tiny --pretrained --dataset folder --data-dir /data/pets \\\n"
                    "    --img-size 224 --epochs 30",
                    "linvision-benchmark --config benchmark_twin_cpu"):
        assert command in quickstart, command
