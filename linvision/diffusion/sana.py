"""Sana's transformer in linvision: diffusers' ``SanaTransformer2DModel`` configs, state dicts and model
folders, converted to and from a caption-conditioned :class:`LinDiT`.

A diffusers model folder is ``config.json`` plus ``diffusion_pytorch_model.safetensors``, or plus several
shards listed by ``diffusion_pytorch_model.safetensors.index.json``. :func:`load_diffusers_folder` reads one
(a Sana checkpoint downloaded by the user) into a LinDiT that runs with linvision's kernels;
:func:`save_diffusers_folder` writes a LinDiT back in that layout, which ``SanaTransformer2DModel.
from_pretrained`` loads. Neither needs diffusers installed.

The weights map one to one, except that linvision stacks diffusers' ``to_q``, ``to_k``, ``to_v`` of the
self-attention into ``qkv`` and the cross-attention's ``to_k``, ``to_v`` into ``kv``. The linear attention's
eps differs: diffusers adds 1e-15 to the sum-form denominator sum_j phi(q).phi(k_j); linvision's default adds
1e-4 to the mean form, i.e. N * 1e-4 to the sum form (0.1 at 32 x 32 latents), which keeps the division finite
where the ReLU features of a query and all keys barely overlap and changes the output only where
phi(q).sum_j phi(k_j) is not large against N * 1e-4. ``exact_eps=True`` gives diffusers' 1e-15 in the sum
form (computed in the mean form with 1e-15 / N in fp32, so it stays finite in half precision).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from linvision.utils.files import write_checkpoint_folder

from .model import DiTConfig, LinDiT

__all__ = ["DIFFUSERS_CLASS", "config_from_diffusers", "config_to_diffusers", "state_dict_from_diffusers",
           "state_dict_to_diffusers", "diffusers_folder_config", "load_diffusers_weights", "load_diffusers_folder",
           "save_diffusers_folder"]

DIFFUSERS_CLASS = "SanaTransformer2DModel"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_EPS = 1e-15

# SanaTransformer2DModel's defaults: config.json may leave any of these out
_DEFAULTS: Dict[str, Any] = dict(
    in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
    num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304,
    mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=32, patch_size=1, norm_elementwise_affine=False,
    norm_eps=1e-6, interpolation_scale=None, guidance_embeds=False, guidance_embeds_scale=0.1, qk_norm=None,
    timestep_scale=1.0,
)
# what the linvision model computes, for the keys it has no field for
_FIXED = dict(dropout=0.0, attention_bias=False, norm_elementwise_affine=False, norm_eps=1e-6,
              interpolation_scale=None)
# read by diffusers' pipelines, not by the transformer: kept on the model and written back
_PIPELINE_KEYS = ("guidance_embeds_scale", "timestep_scale")
_QK_NORMS = (None, "rms_norm_across_heads")


def config_from_diffusers(config: Dict[str, Any], exact_eps: bool = False, source: str = CONFIG_NAME) -> DiTConfig:
    """The DiTConfig of a ``SanaTransformer2DModel`` config (config.json's content). ``exact_eps``: diffusers'
    sum-form eps 1e-15 instead of linvision's default (see the module docstring).

    Raises ValueError naming ``source`` and the key for a config linvision cannot run (another class, a
    positional embedding, attention biases, affine norms, a cross-attention width other than the model's).
    """
    cls = config.get("_class_name", DIFFUSERS_CLASS)
    if cls != DIFFUSERS_CLASS:
        raise ValueError(f"{source}: _class_name is {cls!r}, expected {DIFFUSERS_CLASS!r}")
    c = {**_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    unknown = sorted(set(c) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown} for {DIFFUSERS_CLASS}")
    for key, value in _FIXED.items():
        if c[key] != value:
            raise ValueError(f"{source}: {key}={c[key]!r} is not supported (linvision's Sana needs {value!r})")
    if c["qk_norm"] not in _QK_NORMS:
        raise ValueError(f"{source}: qk_norm={c['qk_norm']!r} is not supported; allowed: {list(_QK_NORMS)}")
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    for key, value in (("cross_attention_dim", c["cross_attention_dim"]),
                       ("num_cross_attention_heads * cross_attention_head_dim",
                        c["num_cross_attention_heads"] * c["cross_attention_head_dim"])):
        if value != dim:
            raise ValueError(f"{source}: {key} = {value} must equal num_attention_heads * attention_head_dim = {dim}")
    return DiTConfig(
        img_size=c["sample_size"], in_chans=c["in_channels"], patch_size=c["patch_size"], dim=dim,
        depth=c["num_layers"], num_heads=c["num_cross_attention_heads"], head_dim=c["attention_head_dim"],
        mlp_ratio=c["mlp_ratio"], num_classes=0, qk_norm=c["qk_norm"] is not None, fp16_clamp=True,
        caption_channels=c["caption_channels"], guidance_embeds=c["guidance_embeds"],
        out_chans=c["out_channels"] or c["in_channels"], qk_norm_eps=1e-5,
        **(dict(eps=DIFFUSERS_EPS, eps_form="sum") if exact_eps else {}),
    )


def config_to_diffusers(cfg: DiTConfig, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The ``SanaTransformer2DModel`` config of a caption-conditioned DiTConfig (``extra``: the pipeline keys
    ``guidance_embeds_scale``, ``timestep_scale``). ValueError for a config diffusers' class cannot express."""
    problems = [name for name, bad in (
        ("num_classes (class labels)", cfg.num_classes > 0), ("caption_channels", cfg.caption_channels <= 0),
        ("self_attn", cfg.self_attn != "linear"), ("self_attn_options", bool(cfg.self_attn_options)),
        ("use_rope", cfg.use_rope),
    ) if bad]
    if problems:
        raise ValueError(f"model config: {DIFFUSERS_CLASS} has no counterpart for {', '.join(problems)}")
    out = {"_class_name": DIFFUSERS_CLASS, "_diffusers_version": _diffusers_version(), **_DEFAULTS, **_FIXED}
    out.update(
        in_channels=cfg.in_chans, out_channels=cfg.out_channels, num_attention_heads=cfg.dim // cfg.head_dim,
        attention_head_dim=cfg.head_dim, num_layers=cfg.depth, num_cross_attention_heads=cfg.num_heads,
        cross_attention_head_dim=cfg.dim // cfg.num_heads, cross_attention_dim=cfg.dim,
        caption_channels=cfg.caption_channels, mlp_ratio=cfg.mlp_ratio, sample_size=cfg.img_size,
        patch_size=cfg.patch_size, guidance_embeds=cfg.guidance_embeds,
        qk_norm="rms_norm_across_heads" if cfg.qk_norm else None,
    )
    out.update({k: v for k, v in (extra or {}).items() if k in _PIPELINE_KEYS})
    return out


def _diffusers_version() -> str:
    try:
        from importlib.metadata import version

        return version("diffusers")
    except Exception:  # not installed: the oldest release with SanaTransformer2DModel
        return "0.32.0"


def _key_map(cfg: DiTConfig) -> List[Tuple[str, List[str]]]:
    """(linvision key, the diffusers keys stacked along dim 0 into it) for every tensor of the model."""
    pairs: List[Tuple[str, List[str]]] = []

    def add(ours: str, *theirs: str) -> None:
        pairs.append((ours, list(theirs)))

    def linear(ours: str, theirs: str, bias: bool = True) -> None:
        add(f"{ours}.weight", f"{theirs}.weight")
        if bias:
            add(f"{ours}.bias", f"{theirs}.bias")

    linear("patch_embed", "patch_embed.proj")
    time = "time_embed" if cfg.guidance_embeds else "time_embed.emb"
    linear("t_embedder.mlp.0", f"{time}.timestep_embedder.linear_1")
    linear("t_embedder.mlp.2", f"{time}.timestep_embedder.linear_2")
    if cfg.guidance_embeds:
        linear("guidance_embedder.mlp.0", "time_embed.guidance_embedder.linear_1")
        linear("guidance_embedder.mlp.2", "time_embed.guidance_embedder.linear_2")
    linear("t_block.1", "time_embed.linear")
    linear("caption_proj.fc1", "caption_projection.linear_1")
    linear("caption_proj.fc2", "caption_projection.linear_2")
    add("caption_norm.weight", "caption_norm.weight")
    for i in range(cfg.depth):
        ours, theirs = f"blocks.{i}", f"transformer_blocks.{i}"
        add(f"{ours}.attn.qkv.weight", *(f"{theirs}.attn1.to_{n}.weight" for n in "qkv"))
        linear(f"{ours}.attn.proj", f"{theirs}.attn1.to_out.0")
        linear(f"{ours}.cross_attn.q", f"{theirs}.attn2.to_q")
        add(f"{ours}.cross_attn.kv.weight", f"{theirs}.attn2.to_k.weight", f"{theirs}.attn2.to_v.weight")
        add(f"{ours}.cross_attn.kv.bias", f"{theirs}.attn2.to_k.bias", f"{theirs}.attn2.to_v.bias")
        linear(f"{ours}.cross_attn.proj", f"{theirs}.attn2.to_out.0")
        if cfg.qk_norm:
            for attn, other in (("attn", "attn1"), ("cross_attn", "attn2")):
                add(f"{ours}.{attn}.q_norm.weight", f"{theirs}.{other}.norm_q.weight")
                add(f"{ours}.{attn}.k_norm.weight", f"{theirs}.{other}.norm_k.weight")
        linear(f"{ours}.ffn.expand", f"{theirs}.ff.conv_inverted")
        linear(f"{ours}.ffn.dwconv", f"{theirs}.ff.conv_depth")
        add(f"{ours}.ffn.project.weight", f"{theirs}.ff.conv_point.weight")
        add(f"{ours}.scale_shift_table", f"{theirs}.scale_shift_table")
    add("final_layer.scale_shift_table", "scale_shift_table")
    linear("final_layer.linear", "proj_out")
    return pairs


def state_dict_from_diffusers(state: Dict[str, Tensor], cfg: DiTConfig, source: str = "state dict"
                              ) -> Dict[str, Tensor]:
    """A ``SanaTransformer2DModel`` state dict as the state dict of ``LinDiT(cfg)``; ValueError naming
    ``source`` and the key for a missing or an unexpected tensor."""
    out, used = {}, set()
    for ours, theirs in _key_map(cfg):
        missing = [k for k in theirs if k not in state]
        if missing:
            raise ValueError(f"{source}: no tensor {missing[0]!r} (the config asks for it)")
        out[ours] = state[theirs[0]] if len(theirs) == 1 else torch.cat([state[k] for k in theirs])
        used.update(theirs)
    unexpected = sorted(set(state) - used)
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''} "
                         f"(does the config fit these weights?)")
    return out


def state_dict_to_diffusers(state: Dict[str, Tensor], cfg: DiTConfig) -> Dict[str, Tensor]:
    """The state dict of ``LinDiT(cfg)`` as a ``SanaTransformer2DModel`` state dict (the inverse of
    :func:`state_dict_from_diffusers`)."""
    config_to_diffusers(cfg)  # refuses class-conditional and other configs diffusers cannot express
    out = {}
    for ours, theirs in _key_map(cfg):
        for key, part in zip(theirs, state[ours].chunk(len(theirs))):
            out[key] = part.contiguous()
    return out


def _read_json(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"diffusers folder: no {os.path.basename(path)} in {os.path.dirname(path)}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"diffusers folder: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"diffusers folder: {path} does not hold a JSON object")
    return data


def _read_weights(folder: str) -> Tuple[Dict[str, Tensor], Dict[str, str]]:
    """(tensors, key -> file) of a single-file or sharded safetensors model folder."""
    index = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"diffusers folder: {index} has no 'weight_map'")
        shards: Dict[str, List[str]] = {}
        for key, name in weight_map.items():
            shards.setdefault(name, []).append(key)
    elif os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
        shards = {WEIGHTS_NAME: []}
    else:
        raise FileNotFoundError(f"diffusers folder: neither {WEIGHTS_NAME} nor {INDEX_NAME} in {folder}")
    state: Dict[str, Tensor] = {}
    where: Dict[str, str] = {}
    for name, keys in shards.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"diffusers folder: shard {path} is missing (it holds {keys[0]!r} and "
                                    f"{len(keys) - 1} more tensors)")
        try:
            part = load_file(path)
        except Exception as e:  # safetensors raises its own error type for truncated or corrupt files
            raise ValueError(f"diffusers folder: cannot read {path} ({str(e).strip()[:200]})") from None
        absent = [k for k in keys if k not in part]
        if absent:
            raise ValueError(f"diffusers folder: {path} lacks {absent[0]!r}, which {INDEX_NAME} places there")
        state.update(part)
        where.update({k: path for k in part})
    return state, where


def diffusers_folder_config(path: str, exact_eps: bool = False) -> DiTConfig:
    """The DiTConfig of a local ``SanaTransformer2DModel`` folder's config.json (see :func:`config_from_diffusers`);
    FileNotFoundError / ValueError naming the file."""
    config_path = os.path.join(path, CONFIG_NAME)
    return config_from_diffusers(_read_json(config_path), exact_eps=exact_eps, source=config_path)


def load_diffusers_weights(model: LinDiT, path: str) -> None:
    """Load the weights of a local ``SanaTransformer2DModel`` folder (safetensors, single or sharded) into
    ``model`` (whose config must describe them; options that change no tensor, such as the eps or RoPE, may
    differ). Raises FileNotFoundError naming a missing shard, ValueError naming the file and the key for a
    missing, unexpected or misshapen tensor."""
    config_path = os.path.join(path, CONFIG_NAME)
    config = _read_json(config_path)
    state, where = _read_weights(path)
    ours = state_dict_from_diffusers(state, model.cfg, source=path)
    own = model.state_dict()
    for key, theirs in _key_map(model.cfg):
        need = (own[key].shape[0] // len(theirs), *own[key].shape[1:])  # one part of a stacked tensor
        bad = next((k for k in theirs if tuple(state[k].shape) != need), None)
        if bad is not None:
            raise ValueError(f"diffusers folder: {where[bad]}: {bad!r} has shape {tuple(state[bad].shape)}, which "
                             f"does not fit the model {config_path} describes (it needs {need})")
    model.load_state_dict(ours)
    model.diffusers_extra = {k: config[k] for k in _PIPELINE_KEYS if k in config}


def load_diffusers_folder(path: str, exact_eps: bool = False, device: str = "cpu",
                          dtype: Optional[torch.dtype] = None) -> LinDiT:
    """A LinDiT with the weights of a local ``SanaTransformer2DModel`` folder (config.json + safetensors,
    single or sharded), in eval mode. ``exact_eps``: see the module docstring.

    Raises FileNotFoundError naming a missing config or shard, ValueError naming the file and the key for a
    config linvision cannot run, a missing or unexpected tensor, or a tensor whose shape the config contradicts.
    """
    model = LinDiT(diffusers_folder_config(path, exact_eps))
    load_diffusers_weights(model, path)
    return model.to(device=device, dtype=dtype).eval()


def save_diffusers_folder(model: LinDiT, path: str, max_shard_bytes: Optional[int] = None) -> None:
    """Write ``model`` as a ``SanaTransformer2DModel`` folder (config.json and the safetensors weights, in
    shards of at most ``max_shard_bytes`` with an index when given and needed), as one unit
    (:func:`linvision.utils.files.write_checkpoint_folder`)."""
    cfg = model.cfg
    config = config_to_diffusers(cfg, getattr(model, "diffusers_extra", None))
    state = {k: v.detach().cpu().contiguous() for k, v in state_dict_to_diffusers(model.state_dict(), cfg).items()}
    shards: List[Dict[str, Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes

    def write_json(data: Dict[str, Any]):
        def write(p: str) -> None:
            with open(p, "w") as f:
                json.dump(data, f, indent=2)
        return write

    files = {CONFIG_NAME: write_json(config)}
    if len(shards) == 1:
        files[WEIGHTS_NAME] = lambda p: save_file(shards[0], p, metadata={"format": "pt"})
    else:
        names = [f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        total = sum(t.numel() * t.element_size() for t in state.values())
        files[INDEX_NAME] = write_json({"metadata": {"total_size": total},
                                        "weight_map": {k: n for n, s in zip(names, shards) for k in s}})
        for name, shard in zip(names, shards):
            files[name] = lambda p, shard=shard: save_file(shard, p, metadata={"format": "pt"})
    write_checkpoint_folder(path, files)
