"""Deprecated: the former home of the tools' library code, now in rooms by job (``linvision.utils``, ``.data``,
``.training``, ``.benchmark``, ``.experiments``, ``.export``; docs/contributing.md draws the floors).

The names and modules it held still import from here, each with a DeprecationWarning that names its new home:
``from linvision.engine import load_model`` gives :func:`linvision.load_model`, and ``import
linvision.engine.train`` gives :mod:`linvision.training.train` itself (the same module object, so patching
either patches both).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# the former modules, by the name they had here
MOVED_MODULES = {
    "amp": "linvision.utils.amp", "cli": "linvision.utils.cli", "config": "linvision.utils.config",
    "distributed": "linvision.utils.distributed", "files": "linvision.utils.files",
    "interrupt": "linvision.utils.interrupt", "run_folder": "linvision.utils.run_folder",
    "checkpoint": "linvision.utils.checkpoint", "factory": "linvision.utils.factory",
    "data": "linvision.data.datasets", "image_check": "linvision.data.image_check",
    "in_memory": "linvision.data.in_memory", "texture_data": "linvision.data.texture",
    "mosaic_data": "linvision.data.mosaic", "seg_data": "linvision.data.segmentation",
    "naflex_loader": "linvision.data.naflex", "run_data": "linvision.data.run_data",
    "train": "linvision.training.train", "train_config": "linvision.training.train_config",
    "resume": "linvision.training.resume", "distill": "linvision.training.distill",
    "evaluate": "linvision.training.evaluate", "validate": "linvision.training.validate",
    "seg_config": "linvision.training.seg_config", "seg_task": "linvision.training.seg_task",
    "seg_metrics": "linvision.training.seg_metrics", "seg_validate": "linvision.training.seg_validate",
    "segmenter": "linvision.training.segmenter",
    "benchmark": "linvision.benchmark.throughput", "flops": "linvision.benchmark.flops",
    "ablate": "linvision.experiments.ablate", "linearize": "linvision.experiments.linearize",
    "export": "linvision.export.program",
}
# the names this package exported, by the module that holds them now
MOVED_NAMES = {
    "load_model": "linvision.utils.checkpoint", "save_checkpoint": "linvision.utils.checkpoint",
    "ConfigError": "linvision.utils.config", "parse_args": "linvision.utils.config",
    "create_model": "linvision.utils.factory", "TrainConfig": "linvision.training.train_config",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; linvision.engine will be removed", DeprecationWarning, stacklevel=3)


def __getattr__(name: str):
    """A moved name or module, warned once: kept here after the first look-up (``from ... import`` looks twice)."""
    if name in MOVED_NAMES:
        _warn(f"linvision.engine.{name}", f"{MOVED_NAMES[name]}.{name}")
        value = getattr(importlib.import_module(MOVED_NAMES[name]), name)
    elif name in MOVED_MODULES:
        _warn(f"linvision.engine.{name}", MOVED_MODULES[name])
        value = importlib.import_module(MOVED_MODULES[name])
    else:
        raise AttributeError(f"module 'linvision.engine' has no attribute {name!r}")
    globals()[name] = value
    return value


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import linvision.engine.NAME`` answered with the module now at MOVED_MODULES[NAME]."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, leaf = fullname.rpartition(".")
        if package == __name__ and leaf in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name.rpartition(".")[2]]
        _warn(spec.name, new)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:  # the module returned by create_module has run already
        pass


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
