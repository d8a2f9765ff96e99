"""linvision: vision models with linear attention.

``import linvision`` registers every linvision model with timm, so that ``timm.create_model(name)`` finds it.
"""
from . import layers, models, ops

__version__ = "0.1.0"
