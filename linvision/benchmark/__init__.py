"""Measuring models: throughput and peak memory at a sweep of sizes, in a child process per point, and its
tables (throughput.py); their figures (plots.py); parameter and FLOP counts (flops.py). Imports training/ and
below."""
