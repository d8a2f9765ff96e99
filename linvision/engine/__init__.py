"""Library code behind tools/: training, validation, benchmarking and ablation.

``load_model(folder)`` rebuilds a trained model from a checkpoint or run folder written by tools/train.py.
"""
from .checkpoint import load_model, save_checkpoint
from .config import ConfigError, parse_args
from .factory import create_model
from .train_config import TrainConfig
