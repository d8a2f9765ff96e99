"""Data for the tools: datasets, transforms and loaders (datasets.py), the offline sets (texture.py, mosaic.py,
in_memory.py), every image checked before training (image_check.py), timm's NaFlex batches (naflex.py),
segmentation data (segmentation.py) and the data a run recorded (run_data.py). Imports utils/ and below."""
