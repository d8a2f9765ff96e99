"""Deployment: torch.export (fixed and dynamic batch, height, width) and ONNX Runtime give eager's outputs at
other sizes than the traced one; TorchScript exclusions stay true; the export tool checks its file in one line."""
import fnmatch
import json
import os
import warnings

import pytest
import timm
import torch

import linvision
from linvision.export.program import (compare_with_eager, export_onnx, export_program, fixed_grid, input_constraints,
                                      load_exported)
from support import ALL_NAMES, reduced_kwargs, run_tool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# One model of each family and position scheme runs by default; the rest with --runslow.
DEFAULT = ("linvit_small_patch16_224", "linvit_small_patch16_rope_224", "linhier_tiny_224", "mlla_tiny", "ravlt_tiny")
ONNX_DEFAULT = ("linvit_small_patch16_rope_224", "ravlt_tiny")  # an ONNX export takes 7-25 s (mlla_tiny's 25)
EXPORT = [pytest.param(n, id=n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in ALL_NAMES]
FIXED_DEFAULT = "linhier_tiny_224"  # the fixed-size export by default
# The tolerance of an exported graph against eager: |diff| <= 1e-4 * max(1, |eager output|) (float32).
TOLERANCE = 1e-4
# TorchScript, as timm excludes its own models (its tests' EXCLUDE_JIT_FILTERS): every linvision model is excluded.
# The mixers take Python objects TorchScript cannot type (a Rope dataclass of tensors and table caches, mixer classes
# from a registry, keyword options filtered by signature) and raise errors built with f-strings; torch 2.14 deprecates
# torch.jit.script in favour of torch.export, which every model supports (above). The test keeps the list true.
EXCLUDE_JIT_FILTERS = ["*"]


def _model(name):
    torch.manual_seed(0)
    return timm.create_model(name, **reduced_kwargs(name)).eval()


def _sizes(model):
    """The traced size and two others the model takes (only its own for a fixed-size model; only the traced one
    for a model whose window attention fixes the graph's grid)."""
    stride, fixed = input_constraints(model)
    if fixed:
        return [fixed]
    if fixed_grid(model):
        return [(2 * stride, 3 * stride)]
    return [(2 * stride, 3 * stride), (3 * stride, 3 * stride), (5 * stride, 2 * stride)]


def _assert_close(rows):
    for row in rows:
        assert row["max_abs_diff"] <= TOLERANCE * max(1.0, row["max_abs_output"]), row


@pytest.mark.parametrize("name", [pytest.param(n, id=n, marks=[] if n == FIXED_DEFAULT else [pytest.mark.slow])
                                  for n in ALL_NAMES])
def test_torch_export_at_the_traced_size(name):
    """A plain trace (``dynamic=False``), batch 2 at the traced size; the dynamic export below covers the same
    graph, so one model runs by default."""
    model = _model(name)
    size = _sizes(model)[0]
    fixed = export_program(model, size, dynamic=False).module()
    _assert_close(compare_with_eager(model, fixed, [size], batch=2))


@pytest.mark.parametrize("name", EXPORT)
def test_torch_export_with_dynamic_sizes(name):
    model = _model(name)
    sizes = _sizes(model)
    x = torch.randn(1, 3, *sizes[0])
    with torch.no_grad():
        before = model(x)
    dynamic = export_program(model, sizes[0]).module()
    rows = compare_with_eager(model, dynamic, sizes, batch=1) + compare_with_eager(model, dynamic, sizes, batch=3)
    _assert_close(rows)
    # tracing leaves nothing behind: eager still computes real tensors, the same as before
    with torch.no_grad():
        after = model(x)
    assert type(after) is torch.Tensor
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("name", [pytest.param(n, id=n, marks=[] if n in ONNX_DEFAULT else [pytest.mark.slow])
                                  for n in DEFAULT])
def test_onnx_runtime_matches_eager_at_224_320_512(name, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = _model(name)
    stride, fixed = input_constraints(model)
    path = str(tmp_path / f"{name}.onnx")
    export_onnx(model, fixed or (224, 224), path)
    sizes = [fixed] if fixed else [(224, 224), (320, 320), (512, 512)]
    rows = compare_with_eager(model, load_exported(path, "onnx"), sizes, batch=2)
    _assert_close(rows)
    assert len(rows) == (1 if fixed else 3)


def test_exported_graph_holds_no_fused_kernel():
    """A call that could only run on the kernels (backend="triton") fails in one line when it is exported."""
    from linvision.ops import linear_attention

    class Attend(torch.nn.Module):
        def forward(self, q):
            return linear_attention(q, q, q, "elu", backend="triton")

    with pytest.raises(ValueError, match="cannot run this call: the call is being exported"):
        torch.export.export(Attend(), (torch.randn(1, 2, 8, 16),))


@pytest.mark.parametrize("strict", [False, True])
def test_compiled_calls_are_not_taken_for_exports(monkeypatch, strict):
    """Some torch releases (2.11 among them) answer ``torch.compiler.is_exporting()`` with True inside any
    TorchDynamo trace, torch.compile's included; played here by replacing it with a function that always says
    True. linvision's check reads the flag torch.export sets, so a compiled call stays off the export path (no
    refusal, the kernels' output) and an exported one, strict or not, is still refused."""
    from linvision.ops import linear_attention, linear_attention_reference
    from linvision.ops.common import is_exporting

    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert not is_exporting()
    q = torch.randn(1, 2, 8, 16)
    seen = []

    def attend(q):
        seen.append(is_exporting())
        return linear_attention(q, q, q, "elu", backend="triton")

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":  # the kernels can run the call
        out = torch.compile(attend, backend="eager", fullgraph=True)(q.to(DEVICE))
        torch.testing.assert_close(out.cpu(), linear_attention_reference(q, q, q, "elu"), rtol=1e-4, atol=1e-5)
        assert seen == [False]

    class Attend(torch.nn.Module):
        def forward(self, q):
            return attend(q)

    # strict export traces with TorchDynamo, which reports the refusal inside its own error
    refused = (ValueError, torch._dynamo.exc.Unsupported) if strict else ValueError
    with pytest.raises(refused, match="cannot run this call: the call is being exported"):
        torch.export.export(Attend(), (q,), strict=strict)
    assert strict or seen[-1] is True  # (a failed TorchDynamo trace drops its side effects, the append included)


@pytest.mark.parametrize("name", [n for n in ALL_NAMES if any(fnmatch.fnmatch(n, f) for f in EXCLUDE_JIT_FILTERS)])
def test_torchscript_exclusions_hold(name):
    pytest.importorskip("torch.jit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 deprecates torch.jit.script
        # OSError: TorchScript asks for the source of a generated dataclass method (TokenLayout's), e.g. for ViG,
        # whose conv stem scripts and so lets the mixer be reached first; ValueError: TorchScript cannot type the
        # mixers' call context (a NamedTuple whose annotations are postponed strings)
        with pytest.raises((torch.jit.frontend.NotSupportedError, RuntimeError, OSError, ValueError)):
            torch.jit.script(_model(name))


# One model of each window family (their full export test is slow: above), at a size whose maps need the shift and
# the padding together: at 160 x 128 Pola-Swin's window-7 stage 3 is 10 x 8 (shifted along both axes, padded to
# 14 x 14); CSWin's stripes are cut by the maps' edges. The graph is traced at batch 2 and run at batch 3.
WINDOW_FAMILIES = ("pola_swin_tiny", "inline_cswin_tiny")
WINDOW_SIZE = (160, 128)


@pytest.mark.parametrize("name", WINDOW_FAMILIES)
def test_window_attention_models_export_at_one_size(name):
    """Swin's shifted windows and CSWin's stripes follow the input size (window count, padding, shift), which a
    torch.export graph cannot keep symbolic: those models export with a dynamic batch at the traced size, and the
    exported graph computes eager's output there at another batch (at other sizes a program is exported per
    size)."""
    from linvision.export.program import dynamic_shapes

    model = _model(name)
    assert fixed_grid(model) and set(dynamic_shapes(model)[0]) == {0}
    program = export_program(model, WINDOW_SIZE).module()
    rows = compare_with_eager(model, program, [WINDOW_SIZE], batch=3)
    for row in rows:  # relative to the logits themselves (about 0.1 here): a graph of zeros fails
        assert row["max_abs_diff"] <= TOLERANCE * row["max_abs_output"], row


def test_other_models_export_a_dynamic_grid():
    from linvision.export.program import dynamic_shapes

    assert not fixed_grid(_model("inline_pvt_tiny")) and set(dynamic_shapes(_model("inline_pvt_tiny"))[0]) == {0, 2, 3}


def test_export_tool_checks_its_file_and_answers_bad_input(tmp_path):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "vit.onnx"
    bench = tmp_path / "bench.json"
    # a one-block ViT: the tool's plumbing, not a family's graph (ONNX_DEFAULT's models are those)
    proc = run_tool("export.py", "--model", "linvit_small_patch16_rope_224", "--model-kwargs", "depth=1",
                    "--img-size", "64", "--output", str(out), "--check-sizes", "64", "96", "--bench-sizes", "64",
                    "--bench-iters", "1", "--bench-out", str(bench))
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("exported linvit_small_patch16_rope_224 (onnx, dynamic batch, height and width "
                               "(multiples of 16), example 64x64)")
    assert lines[1].startswith(f"check {out} against eager at 64x64, 96x96: max |diff| ") and lines[1].endswith(": ok")
    record = json.loads(bench.read_text())
    assert record["rows"][0]["size"] == 64 and record["rows"][0]["onnx_img_s"] > 0
    program = tmp_path / "vit.pt2"
    run_tool("export.py", "--model", "linvit_small_patch16_rope_224", "--model-kwargs", "depth=1",
             "--output", str(program), "--img-size", "64")
    assert torch.export.load(str(program)).module()(torch.randn(2, 3, 48, 80)).shape == (2, 1000)
    for args, message in (
        (["--model", "mlla_tiny", "--output", "x.bin"], "error: format: 'bin'"),
        (["--model", "mlla_tiny", "--output", "x.pt2", "--img-size", "100"], "sides must be multiples of 32"),
        (["--model", "linvit_small_patch16_224", "--output", "x.pt2", "--img-size", "320"], "takes only 224x224"),
        (["--model", "no_such_model", "--output", "x.pt2"], "error: model: unknown 'no_such_model'"),
    ):
        proc = run_tool("export.py", *args, check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


class _OnGrid(torch.nn.Module):
    """A token mixer on a channels-last grid (B, H, W, C), as the blocks call it."""

    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer

    def forward(self, x):
        b, h, w, c = x.shape
        return self.mixer(x.reshape(b, h * w, c), (h, w)).reshape(b, h, w, c)


RECURRENT = ("bidir_delta", "bidir_gated", "bidir_decay")
# traced at 8 x 12 (96 tokens: three whole chunks of 32), run where the last chunk is partial, where there is a
# single short chunk, and at many chunks
OTHER_GRIDS = [(6, 6), (5, 7), (1, 3), (40, 33)]


def _grid_mixer(name):
    from linvision.layers import create_mixer
    torch.manual_seed(0)
    return _OnGrid(create_mixer(name, 32, 2)).eval()


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_mixers_export_with_dynamic_sizes(name):
    """The chunked scans keep the number of chunks symbolic (torch's scan operator instead of a Python loop, padding
    that is never empty): one graph gives eager's outputs at every grid, whatever the traced one was."""
    module = _grid_mixer(name)
    dims = ({0: torch.export.Dim("b", min=1, max=64), 1: torch.export.Dim("h", min=1, max=512),
             2: torch.export.Dim("w", min=1, max=512)},)
    program = torch.export.export(module, (torch.randn(2, 8, 12, 32),), dynamic_shapes=dims).module()
    for grid in [(8, 12)] + OTHER_GRIDS:
        x = torch.randn(3 if grid == (5, 7) else 1, *grid, 32)
        with torch.no_grad():
            expected = module(x)
        torch.testing.assert_close(program(x), expected, rtol=0, atol=TOLERANCE * max(1.0, expected.abs().max()))


@pytest.mark.parametrize("name", ["bidir_delta", "bidir_gated"])
def test_recurrent_mixers_run_in_onnx_runtime_at_other_sizes(name, tmp_path):
    """ONNX has no triangular solve: exported, the delta rule's chunk solve is the same solution from products."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    module = _grid_mixer(name)
    dims = ({1: torch.export.Dim("h", min=1, max=512), 2: torch.export.Dim("w", min=1, max=512)},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (torch.randn(1, 8, 12, 32),), dynamo=True, dynamic_shapes=dims,
                                    input_names=["x"], verbose=False)
    program.save(str(tmp_path / "mixer.onnx"))
    session = ort.InferenceSession(str(tmp_path / "mixer.onnx"), providers=["CPUExecutionProvider"])
    for grid in OTHER_GRIDS:
        x = torch.randn(1, *grid, 32)
        with torch.no_grad():
            expected = module(x)
        got = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
        torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE * max(1.0, expected.abs().max()))
