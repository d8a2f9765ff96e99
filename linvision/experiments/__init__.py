"""Experiments on trained networks: the MambaOut-style ablation, the same network with its token mixer swapped
(ablate.py), and linearizing a softmax ViT into linear attention (linearize.py). Imports benchmark/ and below."""
