"""Session-wide test setup. Without CUDA, Triton kernels run under the interpreter; triton's
`jit` decides that when a kernel is decorated, so the switch must be set before any test module
imports a kernel module (test_kernel_launch.py is collected before test_ops_triton.py).

Files with `slow` tests run first (`pytest_collection_modifyitems`), for CI's two workers."""

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


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.partition("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with the most tests marked `slow` first, the others after them in collection
    order; a file's own tests keep their order. Under `-n 2 --dist loadfile
    --no-loadscope-reorder` (.ci/run) xdist hands whole files to its workers in this order,
    so the long files start early and the run ends on short ones: a long file handed out
    last keeps one worker busy while the other has nothing left to do (xdist's own order,
    most tests first, puts the few-test files, server and subprocess runs, last)."""
    slow: dict[str, int] = {}
    for item in items:
        counted = slow.setdefault(_file_of(item), 0)
        slow[_file_of(item)] = counted + (item.get_closest_marker("slow") is not None)
    rank = {path: i for i, path in enumerate(slow)}
    items.sort(key=lambda item: (-slow[_file_of(item)], rank[_file_of(item)]))
