"""Device-dependent defaults and how the KV pool is sized (lockstep/config.py,
lockstep/engine/memory.py). The CUDA defaults are resolved from a config that names the
device; nothing here needs or imitates a GPU beyond that."""

from __future__ import annotations

import pytest
import torch

from lockstep.cache.kv_pool import KVPool
from lockstep.config import EngineConfig
from lockstep.engine import memory
from lockstep.engine.cuda_graphs import graph_batch_buckets, graph_context_buckets
from lockstep.errors import ConfigError
from lockstep.models.presets import PRESETS

GIB = 1 << 30


def test_cpu_keeps_modest_defaults() -> None:
    c = EngineConfig(device="cpu")
    assert (c.resolved_max_running, c.resolved_max_batch_tokens, c.resolved_chunk_size) == (
        64, 1024, 512,
    )  # fmt: skip
    assert c.resolved_kv_memory_fraction == 0.3
    assert c.resolved_max_mixed_step_cost == 0.0  # a CPU step costs what its rows cost
    assert not c.use_overlap_decode


@pytest.mark.parametrize("mode", ["deterministic", "reference"])
def test_cuda_defaults_run_batches_of_hundreds_in_every_mode(mode: str) -> None:
    c = EngineConfig(device="cuda", mode=mode)
    assert (c.resolved_max_running, c.resolved_max_batch_tokens, c.resolved_chunk_size) == (
        256, 8192, 4096,
    )  # fmt: skip
    assert c.resolved_kv_memory_fraction == 1.0  # all but the reservation and the headroom
    # Two decode-only steps where mixed steps replay piecewise graphs (the engine takes 0
    # for a model they do not run: its mixed steps are eager, lockstep/engine/step_budget.py).
    assert c.resolved_max_mixed_step_cost == 2.0 and c.output_reserve == 1.0
    assert c.use_overlap_decode and c.use_cuda_graphs and c.use_piecewise_cuda_graphs
    assert not EngineConfig(device="cuda", cuda_graphs=False).use_piecewise_cuda_graphs
    assert not EngineConfig(device="cuda", piecewise_cuda_graphs=False).use_piecewise_cuda_graphs
    resolved = c.resolved_options()
    assert resolved["max_running"] == 256 and resolved["device"] == "cuda"
    assert resolved["dtype"] == "bfloat16" and resolved["kv_tokens"] is None


def test_given_values_win_and_defaults_fit_them() -> None:
    c = EngineConfig(device="cuda", max_batch_tokens=100)
    # The defaults never exceed a budget the user gave: no refusal for an option not given.
    assert (c.resolved_max_running, c.resolved_chunk_size) == (100, 100)
    c = EngineConfig(device="cpu", max_running=8, chunk_size=64, kv_memory_fraction=0.5)
    assert (c.resolved_max_running, c.resolved_chunk_size) == (8, 64)
    assert c.resolved_kv_memory_fraction == 0.5


def test_a_given_value_against_a_default_is_refused_naming_the_default() -> None:
    with pytest.raises(ConfigError, match=r"chunk_size=2048 .* max_batch_tokens=1024 \(the CPU"):
        EngineConfig(device="cpu", chunk_size=2048)
    with pytest.raises(ConfigError, match=r"max_running=300 .* max_batch_tokens=200:"):
        EngineConfig(device="cuda", max_running=300, max_batch_tokens=200)
    EngineConfig(device="cuda", chunk_size=2048)  # within the CUDA default of 8192
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="max_running"):
            EngineConfig(max_running=bad)
    EngineConfig(kv_memory_fraction=1.0)


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        (
            "kv_memory_fraction",
            1.5,
            r"kv_memory_fraction=1.5 is invalid: expected a number in \(0, 1\]",
        ),
        ("kv_memory_fraction", 0, r"kv_memory_fraction=0 is invalid"),
        ("max_batch_tokens", 0, r"max_batch_tokens=0 is invalid: expected an integer >= 1"),
        ("output_reserve", 1.5, r"output_reserve=1.5 is invalid: expected a number in \[0, 1\]"),
        ("output_reserve", True, r"output_reserve=True is invalid"),
        (
            "max_mixed_step_cost",
            0.5,
            r"max_mixed_step_cost=0.5 is invalid: expected 0 \(no bound\)",
        ),
    ],
)
def test_bad_memory_and_scheduling_settings_are_one_line_errors(option, value, expected) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        EngineConfig(**{option: value})
    assert "\n" not in str(info.value)


def test_graph_buckets_cover_every_batch_up_to_max_running() -> None:
    assert graph_batch_buckets(256)[-1] == 256 and graph_batch_buckets(3) == [1, 2, 3]
    buckets = graph_batch_buckets(1000)
    assert buckets[-1] == 1000 and 768 in buckets
    assert max(b - a for a, b in zip(buckets, buckets[1:], strict=False)) <= 256
    assert graph_context_buckets(40960) == [2048, 8192, 32768, 40960]


def _qwen3_8b_reservation() -> tuple[memory.StepWorkspace, int]:
    spec = PRESETS["qwen3-8b"].spec
    per_token = KVPool.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                       torch.bfloat16)  # fmt: skip
    c = EngineConfig(device="cuda")
    buckets = (graph_batch_buckets(c.resolved_max_running),
               graph_context_buckets(spec.max_position))  # fmt: skip
    reserved = memory.step_workspace(
        spec, 2, c.resolved_max_batch_tokens, c.resolved_max_running, buckets
    )
    return reserved, per_token


def test_cuda_reservation_counts_what_a_step_can_use() -> None:
    """Each item of Qwen3-8B's reservation at the CUDA defaults (8192-token steps, 256
    running, graphs for batches up to 256 and contexts up to 40,960), and the total under
    4 GiB."""
    reserved, _ = _qwen3_8b_reservation()
    spec = PRESETS["qwen3-8b"].spec
    vocab, hidden, inter = 151936, 4096, 12288
    per_row = 4 * hidden + 4096 + 2 * 1024 + 2 * 4096 + 3 * inter
    assert reserved.activations == 8192 * per_row * 2
    # Logits only for the rows that need them: 256 sampling rows and 256 prompt-logprob rows,
    # each the bf16 head output, its float32 copy and the float32 log-softmax.
    assert memory.logit_rows(8192, 256) == 256 + memory.PROMPT_LOGPROB_ROWS == 512
    assert reserved.logits == 512 * vocab * (2 + 4 + 4)
    # Sampled rows are chosen 32 at a time.
    assert reserved.sampler == 32 * vocab * memory.SAMPLER_BYTES_PER_LOGIT
    # One shared output (256 rows), the largest capture's rows, and every bucket's inputs:
    # 12 batch buckets (sum 847) in 4 context buckets (sum 83,968).
    static = sum(6 * b * 8 + (4 * b + 2) * 4 for b in graph_batch_buckets(256)) * 4
    static += 847 * 83968 * 4
    assert reserved.graphs == 256 * vocab * 4 * 2 + 256 * (per_row + vocab) * 2 + static
    assert reserved.slack == memory.WORKSPACE_SLACK_BYTES
    assert reserved.total == (reserved.activations + reserved.logits + reserved.sampler
                              + reserved.graphs + reserved.slack)  # fmt: skip
    assert reserved.total <= 4 * GIB
    no_graphs = memory.step_workspace(spec, 2, 8192, 256, None)
    assert no_graphs.graphs == 0 and no_graphs.logits == reserved.logits


@pytest.mark.parametrize(
    ("card", "free_gib", "at_least"),
    [("H100 80 GB", 60.18, 360_000), ("H200", 123.0, 780_000)],
)
def test_cuda_pool_takes_all_but_the_reservation_and_headroom(card, free_gib, at_least) -> None:
    """Qwen3-8B's bf16 weights (16.4 GB) leave about 60 GiB free on an H100 80 GB and 123 GiB
    on an H200: the default pool takes everything but the reservation and the headroom, at
    least 360k / 780k tokens, and the three add up to no more than what is free."""
    reserved, per_token = _qwen3_8b_reservation()
    free = int(free_gib * GIB)
    c = EngineConfig(device="cuda")
    budget = memory.cuda_kv_budget(free, per_token, reserved, c.resolved_kv_memory_fraction)
    assert budget.kv_tokens == (free - reserved.total - memory.HEADROOM_BYTES) // per_token
    assert budget.kv_tokens >= at_least, card
    assert budget.kv_tokens * per_token + reserved.total + memory.HEADROOM_BYTES <= free
    assert "reserved" in budget.describe() and "headroom" in budget.describe()
    assert budget.as_dict()["reserved"]["total"] == reserved.total


def test_a_pool_given_by_hand_that_does_not_fit_is_refused_with_the_arithmetic() -> None:
    reserved, per_token = _qwen3_8b_reservation()
    free = 60 * GIB
    room = free - reserved.total - memory.HEADROOM_BYTES
    memory.refuse_oversized_pool(room // per_token, per_token, free, reserved)  # fits exactly
    with pytest.raises(ConfigError) as info:
        memory.refuse_oversized_pool(room // per_token + 1, per_token, free, reserved)
    message = str(info.value)
    assert message.startswith(f"kv_tokens={room // per_token + 1} is invalid here:")
    assert f"expected at most {room // per_token}" in message and "\n" not in message


def test_cuda_pool_without_room_is_a_clear_error() -> None:
    reserved, per_token = _qwen3_8b_reservation()
    with pytest.raises(ConfigError, match="--max-batch-tokens or --max-running, or give"):
        memory.cuda_kv_budget(reserved.total - 1, per_token, reserved, 0.9)
    snapshots = memory.SnapshotBudget(10, GIB)  # a pool that takes the whole share
    with pytest.raises(ConfigError, match="10 linear snapshots; lower .* or --linear-snapshots"):
        memory.cuda_kv_budget(reserved.total + 10 * GIB, per_token, reserved, 0.9, snapshots)


def test_cpu_pool_is_a_share_of_ram_capped() -> None:
    small = memory.cpu_kv_budget(10 * 1024 * 1024, 1024, 0.3)
    assert small.kv_tokens == int(10 * 1024 * 1024 * 0.3) // 1024 and not small.capped
    large = memory.cpu_kv_budget(64 * GIB, 1024, 0.3)
    assert large.kv_tokens == memory.CPU_DEFAULT_KV_TOKEN_CAP and large.capped


def test_engine_sizes_its_cpu_pool_from_ram_and_reports_how() -> None:
    from lockstep.engine.engine import Engine

    engine = Engine(EngineConfig(model="random:tiny", device="cpu"))
    assert engine.kv_budget is not None and engine.kv_budget.device == "cpu"
    assert engine.pool.num_slots == engine.kv_budget.kv_tokens <= memory.CPU_DEFAULT_KV_TOKEN_CAP
    assert engine.scheduler.max_running == 64 and engine.scheduler.max_batch_tokens == 1024
    given = Engine(EngineConfig(model="random:tiny", device="cpu", kv_tokens=300))
    assert given.kv_budget is None and given.pool.num_slots == 300


def test_hybrid_snapshots_are_a_pool_of_their_own_out_of_the_cache_share() -> None:
    """random:qwen3.5-9b on a 139 GiB H200 at the defaults: a token costs only its 8 attention
    layers' K/V (32 KiB; a snapshot of the 24 linear layers, 50.25 MiB, is no longer charged
    per 32 tokens), the snapshot pool (4 per running request, at most half the cache share)
    comes out of the share once, and the KV pool holds more tokens than a dense Qwen3-8B's
    (680k there), 25 times what a snapshot per chunk left."""
    from lockstep.models.linear_attention import LinearLayout, LinearStatePool

    spec = PRESETS["qwen3.5-9b"].spec
    layout = LinearLayout.of(spec, torch.device("cpu"))
    per_token = memory.bytes_per_token(spec, spec.num_kv_heads, torch.bfloat16)
    snapshot = memory.snapshot_bytes(spec)
    assert per_token == 2 * 8 * 4 * 256 * 2 == 32768
    assert snapshot == layout.snapshot_bytes == 4 * 24 * (3 * 8192 + 32 * 128 * 128) == 52690944
    c = EngineConfig(device="cuda")
    buckets = (graph_batch_buckets(256), graph_context_buckets(spec.max_position))
    reserved = memory.step_workspace(spec, 2, 8192, 256, buckets)
    # What is free after the bf16 weights and the 257 working-state slots (allocated first).
    free = 139 * GIB - 2 * spec.num_parameters - 257 * LinearStatePool.slot_bytes(layout)
    cache = memory.cuda_cache_bytes(free, reserved, c.resolved_kv_memory_fraction)
    count = memory.default_linear_snapshots(256, snapshot, cache)
    assert count == int(cache * memory.SNAPSHOT_SHARE) // snapshot < 4 * 256  # the cap binds
    snapshots = memory.SnapshotBudget(count, snapshot)
    budget = memory.cuda_kv_budget(free, per_token, reserved, 1.0, snapshots)
    assert budget.kv_tokens == (cache - count * snapshot) // per_token
    assert budget.kv_tokens * per_token + snapshots.total <= cache
    per_chunk = cache // (per_token + -(-snapshot // 32))  # a snapshot charged per 32 tokens
    assert budget.kv_tokens > 1_000_000 and budget.kv_tokens > 25 * per_chunk
    line = budget.describe()
    assert f"linear snapshots {count} x 50.25 MiB" in line
    assert f"the memory of {snapshots.total // per_token} KV tokens" in line
    # Given a pool size or a KV size, the default is what is asked or 4 per running request.
    assert memory.default_linear_snapshots(64, snapshot, None) == 256
    assert memory.default_linear_snapshots(64, snapshot, 10**15) == 256


def test_cpu_pool_takes_the_snapshots_out_of_its_share() -> None:
    snapshots = memory.SnapshotBudget(3, 100 * 1024)
    budget = memory.cpu_kv_budget(10 * 1024 * 1024, 1024, 0.3, snapshots)
    assert budget.kv_tokens == (int(10 * 1024 * 1024 * 0.3) - 3 * 100 * 1024) // 1024
    assert "less 0.00 GiB of linear snapshots; linear snapshots 3 x 0.10 MiB" in budget.describe()


def test_linear_snapshot_options_are_checked() -> None:
    assert EngineConfig().linear_snapshots is None
    assert EngineConfig().linear_snapshot_interval == 512
    EngineConfig(linear_snapshots=0, linear_snapshot_interval=32)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="linear_snapshots="):
            EngineConfig(linear_snapshots=bad)
    with pytest.raises(ConfigError, match=r"linear_snapshot_interval=100 .* multiple .* 32"):
        EngineConfig(linear_snapshot_interval=100)
    with pytest.raises(ConfigError, match="linear_snapshot_interval=0"):
        EngineConfig(linear_snapshot_interval=0)


def test_a_snapshot_pool_that_cannot_fit_is_refused_before_allocating() -> None:
    """On the CPU the snapshots must fit the caches' share; with --kv-tokens given, the memory
    there is: a clear error naming the option and the count that fits, never an allocation."""
    from lockstep.engine.engine import Engine

    snapshots = memory.SnapshotBudget(100, 1 << 20)
    with pytest.raises(ConfigError, match=r"linear_snapshots=100 .* expected at most 30"):
        memory.cpu_kv_budget(100 << 20, 1024, 0.3, snapshots)
    memory.cpu_kv_budget(100 << 20, 1024, 0.3, memory.SnapshotBudget(30, 1 << 20))  # fits
    with pytest.raises(ConfigError, match="linear_snapshots=10000000000 .* the available RAM"):
        Engine(EngineConfig(model="random:tiny-qwen3.5", device="cpu", kv_tokens=64,
                            linear_snapshots=10**10))  # fmt: skip


def test_mla_fused_input_option_is_a_boolean_and_off_by_default() -> None:
    """The MLA input kernels stay off until they have run compiled on a GPU."""
    assert EngineConfig().mla_fused_input is False
    with pytest.raises(ConfigError, match=r"^mla_fused_input=1 is invalid"):
        EngineConfig(mla_fused_input=1)  # type: ignore[arg-type]
