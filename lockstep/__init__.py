"""Lockstep: an LLM inference engine whose outputs are bit-identical however work is scheduled.

The public Python API is `LLM` and `SamplingParams` (shaped like vLLM's). They are imported
lazily so that `import lockstep` stays cheap and works where server-only packages are absent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lockstep.engine.llm import LLM, RequestOutput
    from lockstep.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from lockstep.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from lockstep.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
