"""Tensor parallelism with the same bits at every degree (docs/design.md, "Tensor parallelism").

`sharding` says which slice of each weight a rank holds and where the fixed reduction chunks
lie; `layers` runs the row-parallel, vocabulary-parallel and column-parallel pieces of a
forward step over `collectives`; `workers` starts, feeds and watches the worker processes.
"""
