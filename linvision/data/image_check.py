"""Every image file of a dataset read once before the first training step, so that a file that cannot be read
stops a run before it starts, all such files named at once, instead of ending it at the step that draws one.

:func:`check_image_files` decodes each file (a JPEG at 1/8 scale, which still reads the whole stream, so a
truncated file is found) on a pool of threads with a progress bar. It knows the datasets backed by files:
torchvision's ``ImageFolder`` (``samples``) and any dataset with ``sample_files()`` and ``keep_samples()``
(:class:`~linvision.data.mosaic.SegmentationFolder`: an image and its mask per sample); others (in
memory, torchvision's packed sets) have nothing to check.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from PIL import Image, UnidentifiedImageError

__all__ = ["BadImageError", "decode_error", "unreadable_reason", "find_unreadable", "check_image_files", "sample_files"]


class BadImageError(ValueError):
    """An image file that cannot be decoded; the message names the file (or every such file of a dataset)."""


def decode_error(e: BaseException) -> str:
    """What an exception of PIL's says of a file it could not decode: "ExceptionType: message"."""
    if isinstance(e, UnidentifiedImageError):  # its message repeats the path
        return "UnidentifiedImageError: not in an image format PIL reads"
    return f"{type(e).__name__}: {e}"


def unreadable_reason(path: str) -> Optional[str]:
    """Why the image file ``path`` cannot be decoded (:func:`decode_error`), or None when it can."""
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            if img.format == "JPEG":
                img.draft(None, (1, 1))  # decode at 1/8 scale: the whole stream is still read
            img.load()
        return None
    except Exception as e:  # PIL raises several types (OSError, SyntaxError, ValueError, ...)
        return decode_error(e)


def sample_files(dataset) -> Optional[List[Tuple[str, ...]]]:
    """The files each sample of ``dataset`` reads, or None for a dataset not backed by files."""
    if hasattr(dataset, "sample_files"):
        return [tuple(files) for files in dataset.sample_files()]
    samples = getattr(dataset, "samples", None)  # torchvision's DatasetFolder / ImageFolder: (path, class)
    if isinstance(samples, list) and all(isinstance(s, tuple) and isinstance(s[0], str) for s in samples):
        return [(s[0],) for s in samples]
    return None


def _keep(dataset, keep: List[int]) -> None:
    if hasattr(dataset, "keep_samples"):
        dataset.keep_samples(keep)
        return
    dataset.samples = [dataset.samples[i] for i in keep]
    dataset.imgs = dataset.samples
    dataset.targets = [target for _, target in dataset.samples]


def find_unreadable(files: Sequence[str], progress: bool = True, desc: str = "reading images") -> List[Tuple[str, str]]:
    """(path, reason) of each file of ``files`` that cannot be decoded, in their order, read on a pool of threads
    with a progress bar."""
    from tqdm import tqdm

    workers = min(16, (os.cpu_count() or 1) * 2)  # decoding releases the GIL; reading waits on the disk
    with ThreadPoolExecutor(workers) as pool:
        reasons = list(tqdm(pool.map(unreadable_reason, files), total=len(files), desc=desc, disable=not progress,
                            unit="file", leave=False))
    return [(path, reason) for path, reason in zip(files, reasons) if reason is not None]


def check_image_files(datasets: Dict[str, object], skip: bool = False, progress: bool = True,
                      find_bad: Optional[Callable[[Sequence[str], str], List[Tuple[str, str]]]] = None,
                      report: Callable[[str], None] = print) -> Dict[str, int]:
    """Decode every file of ``datasets`` ({split name: dataset}). With ``skip`` the samples that read an
    unreadable file are removed from their dataset and ``report`` says how many and which; otherwise one
    ``BadImageError`` (a ValueError) names every such file of every split. Returns {split: samples removed}.

    ``find_bad(files, split)`` replaces the scan (the list of (path, reason) it finds; e.g. one process's scan
    shared with the others of a distributed run).
    """
    found = []
    for split, dataset in datasets.items():
        per_sample = sample_files(dataset)
        if not per_sample:
            continue
        files = sorted({path for sample in per_sample for path in sample})
        bad = find_bad(files, split) if find_bad else find_unreadable(files, progress, f"reading the {split} images")
        if bad:
            found.append((split, dataset, per_sample, files, bad))
    if found and not skip:
        counts = ", ".join(f"{len(bad)} of the {len(files)} {split} files" for split, _, _, files, bad in found)
        listed = "; ".join(f"{path} ({reason})" for *_, bad in found for path, reason in bad)
        raise BadImageError(f"data: {counts} cannot be read: {listed}; remove or replace them, or give "
                            f"--skip-bad-images to train without them")
    removed = {}
    for split, dataset, per_sample, _, bad in found:
        unreadable = {path for path, _ in bad}
        keep = [i for i, sample in enumerate(per_sample) if not unreadable.intersection(sample)]
        _keep(dataset, keep)
        removed[split] = len(per_sample) - len(keep)
        report(f"data: left out {removed[split]} of the {len(per_sample)} {split} samples (--skip-bad-images), "
               f"{len(bad)} unreadable file(s): {', '.join(path for path, _ in bad)}")
    return removed
