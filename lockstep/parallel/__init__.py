"""Tensor parallelism with the same bits at every degree (docs/design.md, "Tensor parallelism").

`sharding` says which slice of each weight a rank holds and where the fixed reduction chunks
lie; `layers` runs the row-parallel, vocabulary-parallel and column-parallel pieces of a
forward step over `collectives`; `group` and `worker` start, feed and watch the worker
processes; `linear_states` keeps a hybrid model's states on every rank.
"""
