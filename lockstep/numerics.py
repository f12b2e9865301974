"""Numeric choices fixed in code that are part of the engine's bits: changing one changes
outputs (docs/design.md, "The contract": the engine version is recorded with every result).
A module without imports, so that the validated config (lockstep/config.py), which the HTTP
process loads without torch, and the models read the same value.
"""

# Rows per chunk of the gated delta rule, at fixed absolute positions 0, C, 2C, ...
# (docs/design.md, "Linear attention"; lockstep/models/linear_attention.py). Radix snapshots
# of the linear-attention state are kept at multiples of it (`linear_snapshot_interval`).
LINEAR_ATTENTION_CHUNK = 32
