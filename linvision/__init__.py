"""linvision: vision models with linear attention.

``import linvision`` registers every linvision model with timm, so that ``timm.create_model(name)`` finds it;
``linvision.load_model(folder)`` rebuilds a model that ``linvision-train`` trained, from its run or checkpoint
folder.
"""
from . import layers, models, ops
from .utils.checkpoint import load_model

__version__ = "0.1.0"
