"""Programmatic dependent launch (PDL): let a kernel's launch and prologue overlap the tail of
the kernel before it, which a batch-1 decode step (~360 short kernels) pays on every kernel.

With PDL (Hopper and later), a kernel launched with `launch_pdl=True` may start as soon as
every program of the kernel before it has signalled `griddepcontrol.launch_dependents`, instead
of when that kernel has finished. Correctness then rests on one rule, kept by construction:
every kernel launched this way calls `wait_for_inputs(PDL)` as its FIRST statement, which
executes `griddepcontrol.wait` (block until the previous grid has completed and its memory is
visible) and only then lets the next kernel launch. Nothing is read or written before the
wait, so no read-after-write or write-after-read hazard can cross a kernel boundary; and since
each kernel signals only after its own wait, the chain stays ordered transitively. Kernels of
other libraries (torch) never signal early, so a PDL kernel after one of them simply waits for
it to finish, as without PDL.

PDL changes when a kernel starts, never what it computes: the bits are the same with it on or
off (tests/test_gpu_engine.py compares), and `LOCKSTEP_PDL=0` switches it off (benchmarks).
The Triton interpreter and GPUs before Hopper run without it.

Two experimental switches (read at import, off; built after the fourth session's device time,
not yet measured): `LOCKSTEP_PDL_TRIGGER_FIRST=1` lets the next kernel launch BEFORE this one's
wait (still safe: the next kernel waits for this one to complete, which cannot happen before
this one's own wait returns, so the order stays transitive), so that a kernel's programs can
be resident a kernel earlier; and the only thing a kernel may do before its wait is
`l2_prefetch` of memory that no kernel writes (weights): a hint that moves bytes into L2 and
returns nothing, so it cannot observe a write (see `lockstep.ops.triton.matmul`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ENABLED: dict[int, bool] = {}
TRIGGER_FIRST = tl.constexpr(os.environ.get("LOCKSTEP_PDL_TRIGGER_FIRST", "0") == "1")


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on this device are launched with PDL (cached per device)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ENABLED:
        major, _ = torch.cuda.get_device_capability(idx)
        _ENABLED[idx] = major >= 9 and os.environ.get("LOCKSTEP_PDL", "1") != "0"
    return _ENABLED[idx]


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments every kernel launch of this package passes: the kernel's `PDL`
    constexpr and, when on, Triton's `launch_pdl` option. The two always agree, so a kernel
    never starts early without the wait at its top."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """First statement of every kernel (after `l2_prefetch` hints at most): wait for the
    previous kernel (its writes visible), then allow the next one to launch (before the wait
    with LOCKSTEP_PDL_TRIGGER_FIRST=1). A no-op when PDL is off."""
    if PDL:
        if TRIGGER_FIRST:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptrs, nbytes):
    """Hint: bring `nbytes` (a multiple of 16) from each 16-byte aligned address of `ptrs` into
    L2 (Hopper's bulk prefetch). Returns nothing, reads nothing into registers: the one thing
    a kernel may do before `wait_for_inputs`, and only on memory no kernel writes."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;",
        "=r,l,r",
        [ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
