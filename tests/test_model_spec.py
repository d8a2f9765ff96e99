"""The hierarchical models as data: the stage and block description a model is built from, options that reach
every block whose mixer takes them (or are refused in one line), and registration that holds whatever the order
of a file's statements."""
import inspect

import pytest
import timm
import torch
from torch import nn

import linvision  # noqa: F401  (registers the models)
from linvision.layers import create_mixer, get_mixer_class
from linvision.layers.registry import mixer_option_default
from linvision.layers.registry import mixer_options
from linvision.models.linhier import BlockSpec, LinHier, StageSpec, linhier_layout

HIER_SMALL = dict(depths=(1, 1, 2, 1), dims=(16, 32, 32, 32), num_heads=(2, 2, 2, 2), img_size=64)
VIT_SMALL = dict(depth=2, embed_dim=32, num_heads=2, img_size=64)


def _linvision_models():
    return [n for n in timm.list_models() if timm.models.model_entrypoint(n).__module__.startswith("linvision.")]


def _small(name, **kwargs):
    """``name`` at a reduced size: a hierarchical model's sizes, else an isotropic one's."""
    torch.manual_seed(0)
    try:
        return timm.create_model(name, **HIER_SMALL, **kwargs)
    except TypeError:
        torch.manual_seed(0)
        return timm.create_model(name, **VIT_SMALL, **kwargs)


def _mixers(model):
    """The blocks' mixers of a model: ((stage, block) or block index, mixer)."""
    if isinstance(model, LinHier):
        return [((i, j), b.mixer) for i, s in enumerate(model.stages) for j, b in enumerate(s.blocks)]
    return [(j, b.mixer) for j, b in enumerate(model.blocks)]


def _families():
    """One reduced model per family: per model class and the mixers of its blocks (an entry point of another
    mixer, e.g. linhier's delta-rule models, is another family)."""
    seen = {}
    for name in _linvision_models():
        model = _small(name)
        key = (type(model).__name__, tuple(type(m).__name__ for _, m in _mixers(model)))
        seen.setdefault(key, name)
    return sorted(seen.values())


FAMILIES = _families()

# Two values of an option that no signature default gives (None defaults, strings, classes).
PAIRS = {
    "rope": (None, "axial"), "feature_map": ("elu", "relu"), "backend": ("auto", "torch"), "eps_form": ("mean", "sum"),
    "rope_origin": ("corner", "center"), "chunk_size": (16, 32), "grid": ((4, 4), (3, 5)),
    "act_layer": (nn.GELU, nn.ReLU), "scale": (None, 0.5),
}
# Options that act only beside another: given with it (alone, see test_lepe_kernel_goes_where_lepe_is_on).
COMPANIONS = {"lepe_kernel": dict(lepe=True), "rope_ref_grid": dict(rope="axial")}
PAIRS["rope_ref_grid"] = (None, (3, 5))  # position interpolation, with RoPE on
PAIRS["lepe_kernel"] = (3, 7)  # its default is None: 3, or 5 for the published mixers that use 5


def _two_values(option, default):
    """Two different values of an option: the table's, else the default and a value of its type next to it."""
    if option in PAIRS:
        return PAIRS[option]
    if isinstance(default, bool):
        return False, True
    if isinstance(default, int):
        return default, default + 2
    if isinstance(default, float):
        return default, default * 2 + 0.125
    if isinstance(default, tuple):
        return default, tuple(_two_values(option, d)[1] for d in default)
    raise AssertionError(f"no second value for option {option}={default!r}: add it to PAIRS")


def _fingerprint(module):
    """What a built module is: its tensors (names and shapes) and its sub-modules' plain attributes; not the
    tensors' values, which an option of another block changes by drawing more or fewer random numbers first."""
    tensors = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    attrs = {(n, k): repr(v) for n, m in module.named_modules() for k, v in vars(m).items()
             if not k.startswith("_") and k != "training" and not isinstance(v, (torch.Tensor, nn.Module))}
    return tensors, attrs


def _build_or_refusal(name, options):
    try:
        return _small(name, mixer_kwargs=options), None
    except ValueError as e:
        return None, str(e)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_mixer_option_reaches_every_block_that_declares_it_or_is_refused_in_one_line(name):
    """For every option a family's mixers declare, two values given through ``mixer_kwargs`` build blocks that
    differ wherever the block's mixer declares the option (its tensors' shapes or its attributes), or the option is
    refused in one line: no block keeps a value the caller did not choose."""
    model = _small(name)
    declared = {}
    for where, mixer in _mixers(model):
        for option in get_mixer_class(type(mixer)).options():
            declared.setdefault(option, []).append((where, type(mixer)))
    checked = 0
    for option, places in sorted(declared.items()):
        values = _two_values(option, mixer_option_default(places[0][1], option))
        companions = COMPANIONS.get(option, {})
        (first, refused_a), (second, refused_b) = (_build_or_refusal(name, {**companions, option: v})
                                                   for v in values)
        if refused_a or refused_b:
            assert "\n" not in (refused_a or refused_b), f"{name}: {option}: a refusal of more than one line"
            continue
        mixers_a, mixers_b = dict(_mixers(first)), dict(_mixers(second))
        for where, _ in places:
            assert _fingerprint(mixers_a[where]) != _fingerprint(mixers_b[where]), (
                f"{name}: {option}={values[0]!r} and {values[1]!r} build the same mixer at {where}: the option vanished")
        checked += 1
    assert checked > 0


def test_cswin_stripes_honours_lepe_and_its_kernel():
    """The stripes' LePE is the mixer's ``lepe`` option: its kernel is ``lepe_kernel``, and ``lepe=False`` has
    none; InLine-CSwin's model-wide ``lepe=False`` reaches every stage, the stripes' included."""
    assert create_mixer("cswin_stripes", 32, 2, lepe=True, lepe_kernel=5).stripe_lepe.weight.shape == (32, 1, 5, 5)
    assert create_mixer("cswin_stripes", 32, 2).stripe_lepe.weight.shape == (32, 1, 3, 3)
    assert create_mixer("cswin_stripes", 32, 2, lepe=False).stripe_lepe is None
    model = timm.create_model("inline_cswin_tiny", depths=(1, 1, 1, 1), mixer_kwargs=dict(lepe=False))
    assert [s.blocks[0].mixer.__class__.__name__ for s in model.stages][2] == "CswinStripeAttention"
    assert model.stages[2].blocks[0].mixer.stripe_lepe is None
    assert all(getattr(s.blocks[0].mixer, "lepe", None) is None for s in model.stages)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert model.eval()(x).isfinite().all()


def _lepe_size(mixer):
    conv = mixer.lepe.conv if hasattr(mixer.lepe, "conv") else mixer.lepe
    return conv.weight.shape[-1]


def test_lepe_kernel_goes_where_lepe_is_on():
    """``lepe_kernel`` sizes the LePE that ``lepe`` turns on: a mixer refuses it alone in one line; a model's
    ``mixer_kwargs`` give it to the blocks whose LePE is on (Pola-Swin: its pola_swin blocks, by their default, not
    its swin_window stages; linhier's, by its layout) and refuse it in one line where no block has one."""
    with pytest.raises(ValueError, match=r"^lepe_kernel: 5 sizes the LePE convolution, which is off"):
        create_mixer("linear", 32, 2, lepe_kernel=5)
    with pytest.raises(ValueError, match=r"^lepe_kernel: 5 sizes the LePE convolution, which is off"):
        create_mixer("cswin_stripes", 32, 2, lepe=False, lepe_kernel=5)
    assert create_mixer("linear", 32, 2, lepe=True, lepe_kernel=5).lepe.weight.shape == (32, 1, 5, 5)
    assert create_mixer("linear", 32, 2, lepe=True).lepe.weight.shape == (32, 1, 3, 3)
    model = _small("pola_swin_tiny", mixer_kwargs=dict(lepe_kernel=7))
    kernels = {type(m).__name__: m.lepe.conv.weight.shape[-1] if hasattr(m.lepe, "conv") else None
               for _, m in _mixers(model) if getattr(m, "lepe", None) is not None}
    assert kernels and set(kernels.values()) == {7}, kernels
    assert {type(m).__name__ for _, m in _mixers(model)} - set(kernels)  # blocks without LePE kept none
    for name in ("linvit_tiny_patch16_224", "inline_swin_tiny"):
        with pytest.raises(ValueError, match=r"^mixer_kwargs: 'lepe_kernel' sizes what 'lepe' turns on, and no "
                                             r"block it is given to has lepe=True \(set lepe=True with it\)$"):
            timm.create_model(name, mixer_kwargs=dict(lepe_kernel=5))
    model = timm.create_model("linhier_tiny_224", depths=(1, 1, 1, 1), mixer_kwargs=dict(lepe_kernel=5))  # lepe on
    assert all(s.blocks[0].mixer.lepe.weight.shape[-1] == 5 for s in model.stages)
    # LePE turned off where a family's (RAVLT: lepe=True, lepe_kernel=5) or the caller's kernel size was given:
    # the size goes with it, the other stages keep theirs
    def kernels(model):
        return [None if s.blocks[0].mixer.lepe is None else _lepe_size(s.blocks[0].mixer) for s in model.stages]

    assert kernels(_small("ravlt_tiny", mixer_kwargs=dict(lepe=False))) == [None] * 4
    assert kernels(_small("mavit_tiny", mixer_kwargs=dict(lepe=False))) == [None] * 4
    assert kernels(_small("ravlt_tiny", stage_mixer_kwargs={0: dict(lepe=False)})) == [None, 5, 5, 5]
    assert kernels(_small("linhier_tiny_224", mixer_kwargs=dict(lepe_kernel=7),
                          stage_mixer_kwargs={1: dict(lepe=False)})) == [7, None, 7, 7]
    with pytest.raises(ValueError, match=r"^stage_mixer_kwargs\[0\]: 'lepe_kernel' sizes what 'lepe' turns on"):
        _small("linhier_tiny_224", stage_mixer_kwargs={0: dict(lepe=False, lepe_kernel=7)})


def test_a_model_is_built_from_its_spec_and_options_reach_one_stage_or_one_block():
    """The spec lists every block's mixer and options (Swin's alternating shift, the family's window, a mixed
    stage's leading blocks, the position tables' grid); options for a stage or a block reach only those
    blocks; options nobody takes, or a place the model lacks, are refused in one line."""
    model = timm.create_model("inline_swin_base", depths=(1, 1, 4, 1), dims=(16, 32, 32, 32),
                              num_heads=(2, 2, 2, 2), stage_mixer_kwargs={2: dict(window=5), (2, 3): dict(window=3)})
    stage = model.spec[2]
    assert [b.mixer for b in stage.blocks] == ["inline_deit", "inline_deit", "swin_window", "swin_window"]
    assert [b.options.get("shift") for b in stage.blocks] == [None, None, False, True]
    assert [b.options.get("window") for b in stage.blocks] == [None, None, 5, 3]
    assert [b.mixer.window for b in model.stages[2].blocks[2:]] == [5, 3]
    assert [b.mixer.shift for b in model.stages[2].blocks[2:]] == [False, True]
    assert model.stages[3].blocks[0].mixer.window == 7 and model.token_mixers[2] == "inline_deit x2+swin_window"
    pola = timm.create_model("pola_pvt_tiny", depths=(1, 1, 1, 1), img_size=128)
    assert pola.spec[1].grid == (16, 16) and pola.spec[1].blocks[0].options["grid"] == (16, 16)
    assert pola.stages[1].blocks[0].mixer.key_pos.shape[1] == 16 * 16 and pola.stem.pos_grid == (32, 32)
    with pytest.raises(ValueError, match=r"^stage_mixer_kwargs\[0\]: 'window' is not an option of the inline_deit"):
        timm.create_model("inline_swin_tiny", depths=(1, 1, 1, 1), stage_mixer_kwargs={0: dict(window=5)})
    with pytest.raises(ValueError, match=r"^stage_mixer_kwargs: \(0, 3\) names no stage or \(stage, block\)"):
        timm.create_model("inline_swin_tiny", depths=(1, 1, 1, 1), stage_mixer_kwargs={(0, 3): dict(scale=2.0)})
    with pytest.raises(ValueError, match=r"^mixer_kwargs: 'stripe' is not an option of the "):
        timm.create_model("inline_swin_tiny", depths=(1, 1, 1, 1), mixer_kwargs=dict(stripe=3))


def test_a_layout_is_data_and_the_model_is_what_it_says():
    """A layout returns plain descriptions; a model built from one has those blocks with the family's mixer
    defaults, nothing else."""
    from linvision.models.linhier import with_family_defaults

    stages = linhier_layout(depths=(1, 2), dims=(16, 32), num_heads=(2, 2), token_mixers="softmax,linear",
                            img_size=64)
    assert stages[1] == StageSpec(32, 2, (BlockSpec("linear", {}),) * 2, (8, 8))
    assert with_family_defaults(stages, dict(gate=True, window=4))[1] == \
        StageSpec(32, 2, (BlockSpec("linear", dict(gate=True)),) * 2, (8, 8))
    class Family(LinHier):
        MIXER_DEFAULTS = dict(gate=True, window=4)

    model = Family(depths=(1, 2), dims=(16, 32), num_heads=(2, 2), token_mixers="softmax,linear", num_classes=3,
                   layout=lambda **kw: linhier_layout(**kw))
    assert model.spec == with_family_defaults(
        linhier_layout(depths=(1, 2), dims=(16, 32), num_heads=(2, 2), token_mixers="softmax,linear"),
        dict(gate=True, window=4))
    assert all(b.mixer.gate is not None for s in model.stages for b in s.blocks)


@pytest.mark.parametrize("name, option, value", [("linhier_tiny_224", "gate", True),
                                                 ("inline_cswin_tiny", "lepe", True),
                                                 ("pola_swin_tiny", "window", 7)])
def test_a_family_keeps_its_mixer_defaults_whatever_the_layout(name, option, value):
    """A family's mixer options are the model's, not its layout's: built with another layout (here the plain
    :func:`linhier_layout`), the blocks whose mixer takes the option still have it; the caller's mixer_kwargs win
    over it."""
    sizes = dict(depths=(1, 1, 1, 1), dims=(16, 32, 32, 48), num_heads=(1, 2, 2, 3))
    taking = [b for s in timm.create_model(name, **sizes).spec for b in s.blocks
              if option in mixer_options(b.mixer)]
    assert taking and all(b.options[option] == value for b in taking)
    plain = timm.create_model(name, **sizes, layout=linhier_layout).spec
    assert [b.options[option] for s in plain for b in s.blocks if option in mixer_options(b.mixer)] == \
        [value] * len(taking)
    other = 5 if option == "window" else False
    mine = timm.create_model(name, **sizes, layout=linhier_layout, mixer_kwargs={option: other}).spec
    assert all(b.options[option] == other for s in mine for b in s.blocks if option in mixer_options(b.mixer))


def test_every_entry_point_has_its_pretrained_cfg():
    """Every registered model's cfg was complete when its entry point registered (timm reads a module's
    ``default_cfgs`` at registration; a cfg added after its entry point is lost without a word)."""
    from timm.models._registry import _model_default_cfgs

    for name in _linvision_models():
        module = inspect.getmodule(timm.models.model_entrypoint(name))
        assert name in _model_default_cfgs, f"{name}: registered without its pretrained cfg"
        assert any(k.split(".")[0] == name for k in module.default_cfgs), name


def test_each_model_file_writes_its_cfgs_once_before_its_entry_points():
    """Registration that no reordering can break: a model file with entry points builds ``default_cfgs`` in one
    statement (``generate_default_cfgs``) above all of them and never adds to it later; a file without entry points
    has none. Checked on the source, so a file that would lose a cfg after a move fails here, not at a download."""
    import ast
    from pathlib import Path

    folder = Path(linvision.__file__).parent / "models"
    checked = 0
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        entries = [n.lineno for n in tree.body if isinstance(n, ast.FunctionDef)
                   and any(getattr(d, "id", None) == "register_model"
                           or getattr(getattr(d, "func", None), "id", None) == "entry_point" for d in n.decorator_list)]
        writes = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "default_cfgs"
                  and isinstance(n.ctx, ast.Store)]
        uses = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", None)
                == "default_cfgs"] + [n for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                                       and getattr(n.value, "id", None) == "default_cfgs"]
        assert not uses, f"{path.name}:{uses[0].lineno} changes default_cfgs after building it"
        if not entries:
            assert not writes, f"{path.name} has cfgs and no entry point"
            continue
        assert len(writes) == 1, f"{path.name} assigns default_cfgs {len(writes)} times"
        built = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0] is writes[0])
        assert getattr(built.value.func, "id", None) == "generate_default_cfgs", path.name
        assert built.lineno < min(entries), f"{path.name}: an entry point above its cfgs (line {min(entries)})"
        checked += 1
    assert checked >= 8

def test_sana_mixers_take_the_layout_their_class_accepts():
    """A Sana self-attention whose class says it takes a batch of images of different sizes takes one."""
    from linvision.diffusion.block import self_attention
    from linvision.layers import MixerContext, TokenLayout, mixer_accepts

    mixer = self_attention(32, head_dim=16, qk_norm=True).eval()
    assert mixer_accepts(mixer, "layout")
    coord = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij"), -1).reshape(1, 6, 2)
    layout = TokenLayout.from_patches(coord, torch.ones(1, 6, dtype=torch.bool))
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(mixer(x, MixerContext((2, 3), layout=layout)), mixer(x, (2, 3)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mlla_base", "ravlt_base"])
def test_rope_ref_grid_is_given_per_stage_in_a_hierarchical_model(name):
    """A hierarchical model's stages run on grids of different sizes, so one ``rope_ref_grid`` for all of them is
    refused in one line naming them; ``stage_mixer_kwargs`` gives each stage its grid at the model's img_size.
    There the model computes exactly what it computes without the option; at another size it interpolates."""
    with pytest.raises(ValueError, match=r"^mixer_kwargs: 'rope_ref_grid' is one grid, and the stages of this "
                                         r"model run on 16x16, 8x8, 4x4, 2x2 at its img_size; give each stage "
                                         r"its own grid with rope_ref_grid=True"):
        _small(name, mixer_kwargs=dict(rope_ref_grid=16))
    with pytest.raises(TypeError, match=r"^rope_ref_grid: True \(each stage's grid at img_size\) or False, got 16"):
        timm.create_model(name, **HIER_SMALL, rope_ref_grid=16)
    grids = {0: 16, 1: 8, 2: 4, 3: 2}
    model = _small(name, stage_mixer_kwargs={i: dict(rope_ref_grid=g) for i, g in grids.items()}).eval()
    # the model's rope_ref_grid=True: the same grids, from each stage's StageSpec.grid
    auto = _small(name, rope_ref_grid=True)
    grid_of = lambda m: [getattr(getattr(x, "attn", x), "rope_ref_grid", None) for _, x in _mixers(m)]  # noqa: E731
    assert grid_of(auto) == grid_of(model) and any(g is not None for g in grid_of(auto))
    plain = _small(name).eval()
    plain.load_state_dict(model.state_dict())
    for (stage, _), mixer in _mixers(model):
        attn = getattr(mixer, "attn", mixer)
        if getattr(attn, "rope_type", None) is not None:
            assert attn.rope_ref_grid == (grids[stage], grids[stage])
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    bigger = torch.randn(1, 3, 96, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
        # the first stage's output (random weights turn little with RoPE: differences of about 1e-4, where fp32
        # rounding alone would leave 1e-6 at most)
        got, want = (m.forward_intermediates(bigger, indices=[0], intermediates_only=True)[0] for m in (model, plain))
    assert (got - want).abs().amax() > 2e-5
