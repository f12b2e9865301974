"""Triton kernels of the deterministic GPU backend, one kernel family per module, each beside
a thin wrapper that checks shapes, strides and dtypes and takes its tile config from a table in
the code. Importing this package needs triton; `lockstep.ops.gpu_deterministic` guards it."""
