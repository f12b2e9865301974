"""Session-wide test setup. Without CUDA, Triton kernels run under the interpreter; triton's
`jit` decides that when a kernel is decorated, so the switch must be set before any test module
imports a kernel module (test_kernel_launch.py is collected before test_ops_triton.py)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
