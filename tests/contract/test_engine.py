"""The serving engine end to end: continuous batching, prefix reuse, eviction, preemption,
abort, seeded sampling, stop conditions, accounting (issue: serving engine).

The central test runs 64 requests (32 on the default model) with overlapping prefixes together
under a KV budget tight enough to force eviction and preemption, and requires exactly the tokens
and logprobs of running each request alone on a cold cache.
"""

from __future__ import annotations

import random

import pytest

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.outputs import StepOutput
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import RequestError


def _engine(model: str | None, **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    options.setdefault("debug_checks", True)
    return Engine(EngineConfig(model=model, device="cpu", dtype="float32", **options))


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results: dict[str, list[StepOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].append(out)
    return {
        rid: (
            [t for o in outs for t in o.new_token_ids],
            [lp for o in outs for lp in o.new_token_logprobs],
            outs[-1].cached_tokens,
            outs[-1].finish_reason,
        )
        for rid, outs in results.items()
    }


def _overlapping_prompts(rng: random.Random, vocab: int, count: int) -> list[list[int]]:
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(8, 40))] for _ in range(5)]
    prompts = []
    for _ in range(count):
        stem = rng.choice(stems)
        cut = rng.randint(1, len(stem))
        prompts.append(stem[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))])
    return prompts


def _assert_pool_free(engine: Engine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats["kv_in_use"] == 0 and stats["num_running"] == 0
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_slots, engine.stats()


# The default model runs half the requests (each is compared with a run of its own, the
# cost of this test); the pool is smaller in proportion, so both still evict and preempt.
@pytest.mark.parametrize(
    ("model", "gen", "kv_tokens", "count"), [("random:tiny", 16, 700, 64), (None, 8, 500, 32)]
)
def test_batched_with_eviction_and_preemption_equals_alone(model, gen, kv_tokens, count) -> None:
    rng = random.Random(0)
    engine = _engine(
        model, kv_tokens=kv_tokens, max_batch_tokens=256, chunk_size=48, output_reserve=0.0
    )
    vocab = engine.decoder.spec.vocab_size
    prompts = _overlapping_prompts(rng, vocab, count)
    params = [
        SamplingParams(max_tokens=gen, temperature=t, seed=i, ignore_eos=True, logprobs=0)
        for i, t in enumerate(rng.choice([0.0, 1.0]) for _ in prompts)
    ]
    together = _run(engine, {f"r{i}": (p, params[i]) for i, p in enumerate(prompts)})
    assert engine.scheduler.num_preemptions > 0, "the KV budget did not force a preemption"
    assert any(cached > 0 for _, _, cached, _ in together.values()), "no prefix was reused"
    _assert_pool_free(engine)

    for i, prompt in enumerate(prompts):
        engine.flush_cache()  # cold cache: the request runs alone from scratch
        alone = _run(engine, {"alone": (prompt, params[i])})["alone"]
        assert alone[2] == 0
        assert together[f"r{i}"][:2] == alone[:2], f"request {i} differs when batched"
    _assert_pool_free(engine)


def test_negative_control_reference_mode_batched_differs() -> None:
    """The same comparison in reference mode must find a difference (the test can fail)."""
    rng = random.Random(1)
    engine = _engine(None, mode="reference", max_batch_tokens=512, chunk_size=256)
    vocab = engine.decoder.spec.vocab_size
    prompts = _overlapping_prompts(rng, vocab, 16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    together = _run(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)})

    def differs_alone(i: int, prompt: list[int]) -> bool:
        engine.flush_cache()
        return _run(engine, {"alone": (prompt, params)})["alone"][1] != together[f"r{i}"][1]

    # One request whose logprobs change alone is the proof: stop at the first.
    assert any(differs_alone(i, prompt) for i, prompt in enumerate(prompts))


def test_seeded_sampling_alone_vs_among_31_others() -> None:
    engine = _engine(None, max_batch_tokens=512)
    rng = random.Random(2)
    vocab = engine.decoder.spec.vocab_size
    probe = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _run(engine, {"probe": (probe, params)})["probe"]
    engine.flush_cache()
    others = {
        f"o{i}": (
            [rng.randrange(vocab) for _ in range(rng.randint(2, 30))],
            SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True),
        )
        for i in range(31)
    }
    batched = _run(engine, {"probe": (probe, params), **others})["probe"]
    assert batched[:2] == alone[:2]
    other_seed = _run(engine, {"p2": (probe, SamplingParams(
        max_tokens=24, temperature=1.0, seed=4321, ignore_eos=True))})["p2"]  # fmt: skip
    assert other_seed[0] != alone[0], "different seeds gave the same 24 tokens"
    _assert_pool_free(engine)


def test_unseeded_request_reports_its_seed_and_reproduces() -> None:
    engine = _engine("random:tiny")
    engine.add_request(
        "a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    seed = outs[-1].seed
    again = _run(engine, {"b": ([1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0,
                                                        seed=seed, ignore_eos=True))})  # fmt: skip
    assert again["b"][0] == [t for o in outs for t in o.new_token_ids]


def test_abort_mid_decode_frees_slots_at_once() -> None:
    engine = _engine("random:tiny")
    engine.add_request("x", list(range(1, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats()["kv_in_use"] > 0
    engine.abort_request("x")
    assert engine.stats()["kv_in_use"] == 0
    assert not engine.has_unfinished()
    _assert_pool_free(engine)


def test_prompt_that_can_never_fit_is_rejected() -> None:
    engine = _engine("random:tiny", kv_tokens=64)
    with pytest.raises(RequestError, match="KV pool"):
        engine.add_request("big", list(range(1, 60)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("long", [1] * (engine.max_model_len + 1), SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestError, match="out of range"):
        engine.add_request("bad", [10**9], SamplingParams())
    assert not engine.has_unfinished()


def test_stop_conditions_and_accounting() -> None:
    engine = _engine(None)
    prompt = engine.tokenizer.encode("1, 2, 3, 4, 5,")
    free_run = _run(engine, {"a": (prompt, SamplingParams(max_tokens=12, temperature=0))})["a"]
    tokens = free_run[0]
    assert free_run[3] in ("length", "stop")
    # A stop token id taken from the free run ends generation right there.
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    res = _run(engine, {"b": (prompt, SamplingParams(max_tokens=12, temperature=0,
                                                     stop_token_ids=[stop_id]))})["b"]  # fmt: skip
    assert res[0] == tokens[: first + 1] and res[3] == "stop"
    # Repeating the prompt hits the cache.
    assert res[2] > 0
    # A stop string cuts the text.
    engine.add_request("c", prompt, SamplingParams(max_tokens=12, temperature=0, stop=[" 8"]))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    text = "".join(o.new_text for o in outs)
    assert " 8" not in text and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == " 8"
    _assert_pool_free(engine)


def test_logprobs_top_alternatives_and_prompt_logprobs() -> None:
    engine = _engine("random:tiny")
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=2)
    engine.add_request("a", [5, 6, 7, 8], params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    pl = outs[0].prompt_logprobs
    assert pl is not None and len(pl) == 4 and pl[0] is None
    assert [e.token_id for e in pl[1:]] == [6, 7, 8]
    for o in outs:
        (lp,) = o.new_logprobs
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the top token
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_slot_table_mirror_tracks_the_list() -> None:
    """The int32 mirror attention reads always equals the slot list, through extends, prefix
    adoptions and clears."""
    from lockstep.engine.request import SlotTable

    rng = random.Random(0)
    table = SlotTable()
    for _ in range(2000):
        op = rng.random()
        if op < 0.6:
            table.extend([rng.randrange(10**6) for _ in range(rng.randint(0, 40))])
        elif op < 0.8 and len(table):
            k = rng.randint(1, len(table))
            table.replace_prefix([rng.randrange(10**6) for _ in range(k)])
        elif op < 0.85:
            table.clear()
        n = rng.randint(0, len(table))
        assert table.array(n).tolist() == table.ids[:n]


def test_attention_meta_from_every_table_kind_matches_a_plain_reference() -> None:
    """build_attention_meta joins the tables with numpy: the engine's int32 arrays, lists and
    CPU tensors must all give the metadata a plain Python construction gives, and a short
    table or a wrong table count is refused."""
    from itertools import accumulate

    import numpy as np
    import torch

    from lockstep.ops.base import build_attention_meta

    rng = random.Random(1)
    for _ in range(50):
        b = rng.randint(1, 9)
        counts = [rng.randint(1, 20) for _ in range(b)]
        starts = [rng.randint(0, 50) for _ in range(b)]
        lists = [[rng.randrange(10**6) for _ in range(s + n + rng.randint(0, 5))]
                 for n, s in zip(counts, starts, strict=True)]  # fmt: skip
        kv = [s + n for n, s in zip(counts, starts, strict=True)]
        want = {
            "cu_q": [0, *accumulate(counts)], "q_start": starts, "kv_len": kv,
            "cu_kv": [0, *accumulate(kv)],
            "slot_table": [x for t, n in zip(lists, kv, strict=True) for x in t[:n]],
        }  # fmt: skip
        kinds = (lists, [np.array(t, dtype=np.int32) for t in lists],
                 [torch.tensor(t, dtype=torch.int64) for t in lists])  # fmt: skip
        for tables in kinds:
            meta = build_attention_meta(counts, starts, tables)
            for name, values in want.items():
                got = getattr(meta, name)
                assert got.dtype == torch.int32 and got.tolist() == values, name
            assert (meta.max_q, meta.max_kv) == (max(counts), max(kv))
    with pytest.raises(ValueError, match="slot table of 3 entries for 5 keys"):
        build_attention_meta([2], [3], [np.arange(3, dtype=np.int32)])
    with pytest.raises(ValueError, match="2 slot tables for 1 sequences"):
        build_attention_meta([2], [3], [np.arange(5, dtype=np.int32)] * 2)


def test_objects_alive_before_an_engine_are_frozen_and_the_engine_stays_collectable() -> None:
    """The engine freezes what exists before it (the collector's full passes then skip torch
    and the rest of the process), never itself: an engine caught in a reference cycle is still
    freed by a collection, weights included. Control: the same cycle around an object frozen
    after it was made stays alive."""
    import gc
    import weakref

    before = object.__new__(type("Before", (), {}))
    engine = Engine(EngineConfig(model="random:tiny", device="cpu", kv_tokens=1024))
    assert gc.is_tracked(before) and gc.get_freeze_count() > 0
    engine.cycle = engine  # only the collector can free it now
    dead_engine, dead_head = weakref.ref(engine), weakref.ref(engine.decoder.lm_head)
    del engine
    gc.collect()
    assert dead_engine() is None and dead_head() is None

    kept = type("Kept", (), {})()
    kept.cycle = kept
    alive = weakref.ref(kept)
    gc.freeze()
    del kept
    gc.collect()
    assert alive() is not None
    gc.unfreeze()
    gc.collect()
    assert alive() is None
