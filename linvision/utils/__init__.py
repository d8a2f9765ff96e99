"""What every tool, trainer and the diffusion stack share: durable file writes (files.py), run folders
(run_folder.py), checkpoint folders (checkpoint.py) and models by name (factory.py), torch.distributed
(distributed.py), autocast (amp.py), signals (interrupt.py), the command line and YAML configs (cli.py,
config.py), and what benchmarks share (measure.py: peak memory, timed calls, a call in a process of its own).
Imports models/ and below only.

``load_model(folder)`` rebuilds a trained model from a checkpoint or run folder written by ``linvision-train``.
"""
from .checkpoint import load_model, save_checkpoint
from .config import ConfigError, parse_args
from .factory import create_model
