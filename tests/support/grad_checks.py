"""What the training backwards' tests measure: `relative` error of a gradient, the autograd node
names of a result (`graph_names`: which backward ran), and `LargestTensor`, a dispatch mode
that records the most elements of any tensor an op returns (no op may build a score-sized
tensor)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over all elements (Frobenius norms), in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def graph_names(t: torch.Tensor) -> set[str]:
    """The class names of every autograd node behind t."""
    names, stack, seen = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack += [n for n, _ in node.next_functions]
    return names
