"""Routed experts (`return_routed_experts`, lockstep/cache/routed_experts.py) through the engine:
every position's experts equal those of one cold full prefill of the request's tokens, alone
or beside batch-mates, after a radix hit, under any prefill chunk size and after preemption.
The model is a tiny Qwen3-MoE folder written by transformers (4 layers, layer 2 dense through
`mlp_only_layers`), so the layout's dense rows are checked too.

Controls: another checkpoint routes otherwise (the comparison sees the routing), and a routing
store whose cached rows were not kept (zeroed after the first run) makes the radix hit's
routing differ from the cold run's (the hit is read from the store, and the test sees it)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from lockstep.cache.routed_experts import bytes_per_token, sglang_layout
from lockstep.engine.llm import LLM
from lockstep.engine.outputs import RequestOutput
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError, RequestError

pytest.importorskip("transformers")
from tests.support.tiny_hf import save_tiny  # noqa: E402

LAYERS, TOP_K, DENSE = 4, 2, 2  # save_tiny("qwen3_moe"): mlp_only_layers=[2]
OPTIONS = {"device": "cpu", "dtype": "float32", "enable_return_routed_experts": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("routed") / "qwen3_moe"
    save_tiny("qwen3_moe", path)
    return path


def _llm(folder: Path, **options) -> LLM:
    return LLM(str(folder), **{**OPTIONS, "kv_tokens": 2048, **options})


def _prompts(seed: int, count: int, stem: int = 12) -> list[list[int]]:
    """Prompts that share stems of various lengths."""
    rng = random.Random(seed)
    base = [rng.randrange(5, 250) for _ in range(stem)]
    return [base[: rng.randint(1, stem)] + [rng.randrange(5, 250) for _ in range(rng.randint(1, 14))]
            for _ in range(count)]  # fmt: skip


def _params(i: int, tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=1.0, seed=100 + i, ignore_eos=True,
                          return_routed_experts=True)  # fmt: skip


def _generate(llm: LLM, prompts: list[list[int]], tokens: int = 8) -> list[RequestOutput]:
    return llm.generate(prompts, [_params(i, tokens) for i in range(len(prompts))], use_tqdm=False)


def _cold(llm: LLM, out: RequestOutput) -> np.ndarray:
    """The experts of one cold full prefill of every position that ran a forward."""
    decoder = llm.engine.decoder
    _, kv = decoder.cold_prefill(out.prompt_token_ids + out.token_ids[:-1], routed_experts=True)
    return sglang_layout(decoder.spec, kv.routed_experts)


def _assert_cold(llm: LLM, outs: list[RequestOutput]) -> None:
    for i, out in enumerate(outs):
        routed = out.routed_experts
        assert routed is not None and routed.dtype == np.int32
        n = len(out.prompt_token_ids) + len(out.token_ids) - 1
        assert routed.shape == (n, LAYERS, TOP_K)
        assert not routed[:, DENSE].any(), "a dense layer's rows must be zero"
        assert np.array_equal(routed, _cold(llm, out)), f"request {i}: routing differs"


def test_alone_and_with_batch_mates_equal_the_cold_prefill(folder: Path) -> None:
    prompts = _prompts(1, 10)
    together_llm = _llm(folder)
    together = _generate(together_llm, prompts)
    _assert_cold(together_llm, together)
    alone_llm = _llm(folder, enable_prefix_cache=False)
    for i in (0, 4, 9):
        (alone,) = alone_llm.generate([prompts[i]], [_params(i)], use_tqdm=False)
        assert alone.token_ids == together[i].token_ids
        assert np.array_equal(alone.routed_experts, together[i].routed_experts)
    together_llm.engine.check_integrity()


def test_a_radix_hit_returns_the_cold_runs_routing_and_a_lost_store_is_caught(
    folder: Path,
) -> None:
    llm = _llm(folder)
    prompt = _prompts(2, 1, stem=20)[0] + list(range(30, 50))
    (first,) = _generate(llm, [prompt])
    (hit,) = _generate(llm, [prompt])
    longer = prompt + [7, 8, 9]
    (extended,) = _generate(llm, [longer])
    assert hit.cached_tokens >= len(prompt) - 1 and extended.cached_tokens >= len(prompt)
    assert np.array_equal(hit.routed_experts, first.routed_experts)
    _assert_cold(llm, [first, hit, extended])
    # Control: the cached rows lost (as a store not written, or not kept, would leave them):
    # the hit's prompt rows no longer equal the cold run's, and the comparison says so.
    assert llm.engine.pool.routed_experts is not None
    llm.engine.pool.routed_experts.zero_()
    (lost,) = _generate(llm, [prompt])
    assert lost.cached_tokens > 0
    assert not np.array_equal(lost.routed_experts, _cold(llm, lost))


@pytest.mark.parametrize("chunk", [3, 7, 64])
def test_any_prefill_chunk_size_gives_the_cold_routing(folder: Path, chunk: int) -> None:
    llm = _llm(folder, chunk_size=chunk, max_batch_tokens=max(chunk, 16),
               enable_prefix_cache=False)  # fmt: skip
    _assert_cold(llm, _generate(llm, _prompts(3, 4, stem=30)))


def test_preemption_recomputes_the_same_routing(folder: Path) -> None:
    llm = _llm(folder, kv_tokens=96, output_reserve=0.0, max_batch_tokens=64, chunk_size=16)
    outs = _generate(llm, _prompts(4, 12, stem=20), tokens=24)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool did not force a preemption"
    _assert_cold(llm, outs)
    llm.engine.check_integrity()


def test_negative_control_other_weights_route_otherwise(folder: Path, tmp_path: Path) -> None:
    """The comparison sees the routing: the same tokens through another checkpoint of the
    same shape route differently somewhere."""
    other_folder = tmp_path / "other"
    save_tiny("qwen3_moe", other_folder, seed=40)
    ours, other = _llm(folder), _llm(other_folder)
    for out in _generate(ours, _prompts(5, 3)):
        assert not np.array_equal(out.routed_experts, _cold(other, out))


def test_the_store_is_sized_counted_and_changes_no_output(folder: Path) -> None:
    llm = _llm(folder, kv_tokens=512)
    engine = llm.engine
    store = engine.pool.routed_experts
    assert store is not None and store.dtype.itemsize == 2
    assert tuple(store.shape) == (512, LAYERS - 1, TOP_K)
    per_token = (LAYERS - 1) * TOP_K * 2
    assert bytes_per_token(engine.decoder.spec) == per_token
    assert engine._bytes_per_token() - engine._bytes_per_token(routing=False) == per_token
    plain_llm = _llm(folder, kv_tokens=512, enable_return_routed_experts=False)
    plain = plain_llm.engine
    assert plain.pool.routed_experts is None
    assert plain._bytes_per_token() == engine._bytes_per_token(routing=False)
    # Keeping the routing changes no token and no logprob.
    prompts = _prompts(6, 4)
    kept = _generate(llm, prompts)
    params = [dataclasses.replace(_params(i), return_routed_experts=False, logprobs=0)
              for i in range(len(prompts))]  # fmt: skip
    without = plain_llm.generate(prompts, params, use_tqdm=False)
    with_lps = llm.generate(prompts, [dataclasses.replace(p, return_routed_experts=True)
                                      for p in params], use_tqdm=False)  # fmt: skip
    for a, b, c in zip(kept, without, with_lps, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert b.logprobs == c.logprobs and b.routed_experts is None


def test_requests_the_engine_cannot_answer_are_refused(folder: Path) -> None:
    plain = _llm(folder, enable_return_routed_experts=False)
    with pytest.raises(RequestError, match="--enable-return-routed-experts"):
        _generate(plain, [[5, 6, 7]])
    dense = LLM("random:tiny", device="cpu", kv_tokens=512)
    with pytest.raises(RequestError, match="not a mixture-of-experts model"):
        _generate(dense, [[5, 6, 7]])
    with pytest.raises(ConfigError, match="enable_return_routed_experts=True is invalid"):
        LLM("random:tiny", device="cpu", kv_tokens=512, enable_return_routed_experts=True)


@pytest.mark.parametrize("preset", ["random:tiny-deepseek-v3", "random:tiny-qwen3.5-moe"])
def test_deepseek_routing_and_a_hybrid_model_give_the_cold_routing(preset: str) -> None:
    """DeepSeek routing (sigmoid scores, a correction bias, expert groups; layer 0 dense) and a
    hybrid Gated DeltaNet MoE: batch-mates and a repeated prompt route as the cold prefill."""
    llm = LLM(preset, device="cpu", kv_tokens=2048, enable_return_routed_experts=True)
    spec = llm.engine.decoder.spec
    assert spec.moe is not None
    prompts = _prompts(7, 5, stem=40)
    outs = _generate(llm, prompts) + _generate(llm, prompts[:2])
    for out in outs:
        dense = [i for i in range(spec.num_layers) if i not in spec.moe.sparse_layers]
        assert out.routed_experts is not None and not out.routed_experts[:, dense].any()
        assert np.array_equal(out.routed_experts, _cold(llm, out))


def test_an_aborted_request_returns_the_routing_of_what_it_computed(folder: Path) -> None:
    engine = _llm(folder).engine
    prompt = _prompts(8, 1, stem=20)[0]
    engine.add_request("r", prompt, _params(0, tokens=50))
    generated: list[int] = []
    while len(generated) < 5:
        for out in engine.step():
            generated += out.new_token_ids
    closing = engine.abort_request("r")
    assert closing is not None and closing.finish_reason == "abort"
    routed = closing.routed_experts
    assert routed is not None and len(routed) >= len(prompt) + len(generated) - 1
    tokens = prompt + generated
    decoder = engine.decoder
    _, kv = decoder.cold_prefill(tokens[: len(routed)], routed_experts=True)
    assert np.array_equal(routed, sglang_layout(decoder.spec, kv.routed_experts))
    engine.check_integrity()
