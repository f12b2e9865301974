"""Developer benchmarks, run from the repository root: e.g. `python -m bench.gpu_kernels`."""
