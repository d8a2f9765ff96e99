"""Sana-style linear-attention diffusion: block, small DiT, rectified-flow training and sampling."""
