"""timm-registered model families; importing this package registers them with ``timm.create_model``."""
from . import linhier, linvit
from .linhier import LinHier
from .linvit import LinViT
