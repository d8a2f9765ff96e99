"""Library code behind tools/: training, validation, benchmarking and ablation."""
