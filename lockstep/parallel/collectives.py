"""The collectives a sharded forward step uses, over torch.distributed.

Only all-gather carries numbers a result depends on: every sum over ranks is done by the
receiver in a fixed order (lockstep.parallel.layers). `all_reduce_sum` (the library's SUM,
whose order follows the message size and the algorithm, NCCL's in particular) exists for the
`all_reduce` reduction, the yardstick and negative control, and nothing else.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Collectives:
    """The default process group of this process: rank `rank` of `size`."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (equal shapes and dtypes on all ranks), in rank order."""
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The library's SUM over ranks (order unspecified: never for deterministic results)."""
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out
