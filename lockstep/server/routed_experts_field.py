"""`meta_info.routed_experts` as SGLang writes it and slime reads it: base64 of the int32
array [len - 1, num_hidden_layers, top_k] (lockstep/cache/routed_experts.py says what the rows
are), little-endian, C order. Torch-free: the HTTP process encodes it.
"""

from __future__ import annotations

import base64

import numpy as np


def encode(routed: np.ndarray) -> str:
    """`meta_info.routed_experts`: base64 of the int32 array's bytes (little-endian, C order)."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype="<i4").tobytes()).decode("ascii")


def decode(text: str, num_layers: int, top_k: int) -> np.ndarray:
    """The inverse of `encode`: int32 [len - 1, num_layers, top_k] (what a trainer reads)."""
    flat = np.frombuffer(base64.b64decode(text), dtype="<i4")
    return flat.reshape(-1, num_layers, top_k).astype(np.int32)
