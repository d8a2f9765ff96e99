"""nn.Modules built on linvision.ops: token mixers (selected by name through the registry), FFNs, blocks."""
from .registry import create_mixer, list_mixers, register_mixer
