"""Triton kernels for linear attention, installed as ``linvision.kernels``."""
