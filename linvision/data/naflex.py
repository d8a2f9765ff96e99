"""Training and validation batches of images at their own aspect ratio, from timm's NaFlex data pipeline.

timm's ``NaFlexMapDatasetWrapper`` cuts an epoch into batches of several sequence lengths (``seq_lens``: patches
per image at most), each batch sized so that it holds about ``batch_size * max(seq_lens)`` patches, every image
resized to fit its batch's sequence length with its aspect ratio kept, patchified and collated into timm's
NaFlex dict (``patches``, ``patch_coord``, ``patch_valid``). Its schedule and shuffling depend only on (seed,
epoch), so :class:`NaFlexBatches` can start an epoch part-way (a resumed run), skipping the batches already
trained on without reading them. Validation uses timm's NaFlex eval transform at one ``max_seq_len`` and its
collator (:func:`naflex_eval_parts`).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, Sequence, Tuple

from timm.data.naflex_dataset import NaFlexCollator, NaFlexMapDatasetWrapper
from timm.data.readers.shared_count import SharedCount

__all__ = ["NaFlexBatches", "naflex_train_batches", "naflex_eval_parts", "check_naflex_model"]


class NaFlexBatches(NaFlexMapDatasetWrapper):
    """timm's NaFlex batch schedule that can start an epoch at a given batch: :meth:`set_position`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.skip = SharedCount(0)  # read by the loader's workers, as timm's epoch is

    def set_position(self, epoch: int, start_batch: int = 0) -> None:
        """Epoch ``epoch``'s batches, from its ``start_batch``-th on."""
        self.set_epoch(epoch)
        self.skip.value = start_batch

    def _prepare_epoch_batches(self, epoch: int) -> List[Tuple[int, int, List[int]]]:
        return super()._prepare_epoch_batches(epoch)[self.skip.value:]


def check_naflex_model(model, name: str) -> Tuple[int, int]:
    """The patch size of ``model``; ValueError in one line for a model that takes no NaFlex batch."""
    if not hasattr(model, "get_patch_size"):
        raise ValueError(f"naflex_loader: {name} takes no NaFlex batch (patches with their coordinates); linvit "
                         f"models do")
    return tuple(model.get_patch_size())


def naflex_train_batches(dataset, patch_size: Tuple[int, int], seq_lens: Sequence[int], batch_size: int,
                         data_config: Dict[str, Any], seed: int, rank: int, world_size: int, *, scale, hflip: float,
                         color_jitter: float, auto_augment, re_prob: float, no_aug: bool) -> NaFlexBatches:
    """The training batches of ``dataset`` (images as PIL, its own transform unset): timm's NaFlex training
    transform (random resized crops to each batch's sequence length, flips, colour jitter, auto-augment, random
    erasing; interpolation, mean and std of ``data_config``) and schedule."""
    from timm.data import create_transform

    dataset.transform = None
    factory: Callable = partial(
        create_transform, is_training=True, no_aug=no_aug, scale=tuple(scale), hflip=hflip,
        color_jitter=color_jitter, auto_augment=auto_augment, interpolation=data_config["interpolation"],
        mean=tuple(data_config["mean"]), std=tuple(data_config["std"]), re_prob=re_prob, use_prefetcher=False,
        naflex=True)
    return NaFlexBatches(dataset, patch_size=patch_size, seq_lens=tuple(seq_lens),
                         max_tokens_per_batch=batch_size * max(seq_lens), transform_factory=factory, seed=seed,
                         shuffle=True, distributed=world_size > 1, rank=rank, world_size=world_size)


def naflex_eval_parts(patch_size: Tuple[int, int], max_seq_len: int, data_config: Dict[str, Any]):
    """(transform, collate_fn) of validation at each image's own aspect ratio: timm's NaFlex eval transform
    (resized to at most ``max_seq_len`` patches, normalised, patchified) and its collator."""
    from timm.data import create_transform

    transform = create_transform(is_training=False, interpolation=data_config["interpolation"],
                                 mean=tuple(data_config["mean"]), std=tuple(data_config["std"]), naflex=True,
                                 patch_size=patch_size, max_seq_len=max_seq_len, patchify=True,
                                 use_prefetcher=False)
    return transform, NaFlexCollator(max_seq_len)
