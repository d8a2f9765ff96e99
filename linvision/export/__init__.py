"""Exporting models: torch.export programs and ONNX files at fixed or dynamic sizes, checked against the eager
model (program.py). Imports utils/ and below."""
