"""Training and validation: the recipe (train_config.py), the run in named steps and the classification task
(train.py), resuming (resume.py), distillation (distill.py), evaluation and validation (evaluate.py,
validate.py), and the segmentation task on the same loop (seg_config.py, segmenter.py, seg_task.py,
seg_metrics.py, seg_validate.py). Imports data/, utils/ and below."""
from .train_config import TrainConfig
