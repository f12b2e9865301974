"""The collectives a sharded forward step uses, over torch.distributed.

Only all-gather and all-to-all carry numbers a result depends on, and they move values: every
sum over ranks is done by the receiver in a fixed order (lockstep.parallel.layers). `all_reduce_sum` (the library's SUM,
whose order follows the message size and the algorithm, NCCL's in particular) exists for the
`all_reduce` reduction, the yardstick and negative control, and nothing else.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class Collectives:
    """One engine's process group, rank `rank` of `size`: gloo on the CPU, NCCL on CUDA.

    The group is a backend object of its own, not torch.distributed's default group, so one
    process may hold several tensor-parallel engines (tests compare degrees side by side)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout: timedelta) -> None:  # fmt: skip
        self.rank = rank
        self.size = size
        if device.type == "cuda":
            self._group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, size, timeout)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (equal shapes and dtypes on all ranks), in rank order."""
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._group.allgather([out], [tensor]).wait()
        return out

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` [size, ...] (equal shapes on all ranks): row r goes to rank r; the result's
        row q is what rank q sent this rank. Moves values, adds nothing."""
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        self._group.alltoall_base(out, tensor, [], []).wait()
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The library's SUM over ranks (order unspecified: never for deterministic results)."""
        out = tensor.clone()
        self._group.allreduce([out]).wait()
        return out
