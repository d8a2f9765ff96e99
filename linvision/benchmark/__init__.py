"""Measuring models: throughput and peak memory at a sweep of sizes, in a child process per point, and its
tables (throughput.py); their figures (plots.py); parameter and FLOP counts (flops.py); NaFlex batches of
mixed-aspect images against softmax attention and square inputs at sequence budgets (naflex.py). Imports
training/ and below."""
