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
off (tests/gpu/test_gpu_engine.py compares). The Triton interpreter and GPUs before Hopper run
without it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ENABLED: dict[int, bool] = {}
_NUM_SMS: dict[int, int] = {}
_SHARED_MEMORY: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached): persistent grids and the attention
    kernel's residency rule size themselves by it."""
    idx = _index(device)
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def shared_memory_per_block(device: torch.device) -> int:
    """The most shared memory one program may use on a CUDA device, in bytes (cached; the
    opt-in limit: 232,448 on an H100/H200)."""
    idx = _index(device)
    if idx not in _SHARED_MEMORY:
        props = torch.cuda.get_device_properties(idx)
        _SHARED_MEMORY[idx] = props.shared_memory_per_block_optin
    return _SHARED_MEMORY[idx]


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1: numpy on the CPU,
    no compiler options, no warps or SMs)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def compiled_for_gpu(device: torch.device) -> bool:
    """Whether kernels on this device are compiled for a CUDA GPU (not interpreted): the
    case where SM counts, residency and PDL mean anything."""
    return device.type == "cuda" and not interpreting()


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on this device are launched with PDL (cached per device)."""
    if not compiled_for_gpu(device):
        return False
    idx = _index(device)
    if idx not in _ENABLED:
        major, _ = torch.cuda.get_device_capability(idx)
        _ENABLED[idx] = major >= 9
    return _ENABLED[idx]


# PDL pays where kernels are short and many, and costs where they are long: a kernel launched
# early holds its SM resources while it waits for the one before it. On the H200 (Qwen3-8B
# shapes) it saves ~0.2 ms of a 4.8-6.2 ms decode step at batch 1 to 32, and costs 0.15 ms at
# batch 64, 0.7 ms of a 21 ms step at batch 256 and 12 ms of a 215 ms 8k-token prefill step
# (docs/results.md). So a launch whose call has more rows (tokens) than this runs without it.
PDL_MAX_ROWS = 32


def pdl_launch(device: torch.device, rows: int) -> dict:
    """Keyword arguments every kernel launch of this package passes: the kernel's `PDL`
    constexpr and, when on, Triton's `launch_pdl` option. The two always agree, so a kernel
    never starts early without the wait at its top. `rows`: the call's rows (tokens, or
    sampled rows); PDL only up to `PDL_MAX_ROWS`. A PDL kernel after one launched without
    it simply waits for it to finish, so calls of either kind mix freely."""
    if rows <= PDL_MAX_ROWS and pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """First statement of every kernel: wait for the previous kernel (its writes visible),
    then allow the next one to launch. A no-op when PDL is off."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
