"""timm-registered model families; importing this package registers them with ``timm.create_model``."""
from . import inline, linhier, linvit, mavit, mlla, polaformer, ravlt, swinhier, vig
from .inline import InLineDeiT
from .linhier import LinHier
from .linvit import LinViT
from .mavit import Mavit
from .mlla import Mlla
from .polaformer import PolaSwin
from .ravlt import Ravlt
from .swinhier import SwinHier
from .vig import Vig
