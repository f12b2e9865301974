"""Session-wide test setup. Without CUDA, Triton kernels run under the interpreter; triton's
`jit` decides that when a kernel is decorated, so the switch must be set before any test module
imports a kernel module (test_kernel_launch.py is collected before test_ops_triton.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny shapes: one torch thread computes instead of waking a pool (bits do not depend on
    the thread count). For a module: `pytestmark = pytest.mark.usefixtures(...)`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
