"""The data a checkpoint's run was trained and validated on, for validating the checkpoint alone: the dataset and
data folder recorded in the config.yaml of the run folder it belongs to, else in its model.json. Used by the
classifiers' (:mod:`.validate`) and the segmenters' (:mod:`.seg_validate`) validation."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from linvision.utils.checkpoint import resolve_checkpoint
from linvision.utils.config import load_yaml

__all__ = ["run_data"]


def _run_config(checkpoint: str) -> Optional[str]:
    """The config.yaml of the run folder that ``checkpoint`` is (or whose best/ or last/ it is); None for a
    checkpoint folder outside a run."""
    folder = resolve_checkpoint(checkpoint)
    candidates = [checkpoint, folder]
    if os.path.basename(os.path.normpath(folder)) in ("best", "last"):
        candidates.append(os.path.dirname(os.path.normpath(folder)))
    for candidate in candidates:
        path = os.path.join(candidate, "config.yaml")
        if os.path.isfile(path):
            return path
    return None


def run_data(checkpoint: str, meta: Dict[str, Any], dataset: Optional[str] = None,
             data_dir: Optional[str] = None) -> Tuple[str, Optional[str], str]:
    """The data to validate ``checkpoint`` on: ``dataset`` and ``data_dir`` where given, else those its run
    recorded: in the config.yaml of the run folder it is (or is the best/ or last/ of), else in its model.json
    (``meta``). A recorded ``data_dir`` is taken only with the dataset it was recorded for; a dataset recorded
    nowhere is ``"folder"``.

    Returns (dataset, data_dir, note), the note one line saying which data it is and where each came from. Shared
    by the classifiers' and the segmenters' validation."""
    config = _run_config(checkpoint)
    records = [(config, load_yaml(config))] if config else []
    records.append((os.path.join(resolve_checkpoint(checkpoint), "model.json"), meta))
    recorded, origin = {}, {}
    for key in ("dataset", "data_dir"):
        for path, record in records:  # the run's record first, the checkpoint's for one outside a run
            if record.get(key) is not None:
                recorded[key], origin[key] = record[key], path
                break
    used_dataset = dataset or recorded.get("dataset") or "folder"
    used_dir = data_dir
    if used_dir is None and used_dataset == recorded.get("dataset"):
        used_dir = recorded.get("data_dir")

    def said(key: str, given: Optional[str]) -> str:
        if given is not None:
            return "as given"
        return f"as {origin[key]} records" if key in origin else "the default"

    how_set, how_dir = said("dataset", dataset), said("data_dir", data_dir)
    if not used_dir:
        note = f"data: {used_dataset}, its validation split ({how_set})"
    elif how_set == how_dir:
        note = f"data: {used_dataset} at {used_dir}, its validation split ({how_set})"
    else:
        note = f"data: {used_dataset} ({how_set}) at {used_dir} ({how_dir}), its validation split"
    return used_dataset, used_dir, note
