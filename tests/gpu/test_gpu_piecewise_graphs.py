"""Piecewise CUDA graphs on the GPU: steps that mix prompt chunks with decodes, replayed as
graph pieces around eager attention (lockstep/engine/piecewise_graphs.py), give the tokens and
logprobs of the same engine running those steps eagerly, bit for bit; a replay whose padding
rows stop being copies of row 0 does not (the negative control)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = ["random:smollm2-135m", "random:tiny-qwen3-moe", "random:tiny-gemma3"]


def _engine(model: str, piecewise: bool):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    return Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", kv_tokens=32768,
                               max_model_len=4096, max_running=32, max_batch_tokens=512,
                               chunk_size=128, piecewise_cuda_graphs=piecewise))  # fmt: skip


def _drive(engine, seed: int = 5) -> tuple[dict, int]:
    """24 requests arriving one every other step (prompts of 1..700 tokens, chunked by 128),
    sampled with a seed each: most steps carry prompt chunks beside decodes. Returns each
    request's (tokens, logprobs) per step and how many steps ran piecewise."""
    from lockstep.engine.sampling_params import SamplingParams

    runs = [0]
    piecewise = engine.runner.piecewise
    if piecewise is not None:
        run = piecewise.run

        def counted(*args, **kwargs):
            runs[0] += 1
            return run(*args, **kwargs)

        piecewise.run = counted
    rng = random.Random(seed)
    vocab = engine.decoder.spec.vocab_size
    arrivals = [
        ([rng.randrange(vocab) for _ in range(rng.randint(1, 700))],
         SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True, logprobs=2))
        for i in range(24)
    ]  # fmt: skip
    out: dict[str, list] = {}
    step = added = 0
    while arrivals or engine.has_unfinished():
        if arrivals and step % 2 == 0:
            prompt, params = arrivals.pop(0)
            engine.add_request(f"r{added}", prompt, params)
            added += 1
        for o in engine.step():
            out.setdefault(o.request_id, []).append(
                (o.new_token_ids, o.new_token_logprobs, o.new_logprobs)
            )
        step += 1
    return out, runs[0]


@pytest.mark.parametrize("model", MODELS)
def test_piecewise_steps_equal_eager_steps(model: str) -> None:
    want, none = _drive(_engine(model, piecewise=False))
    engine = _engine(model, piecewise=True)
    assert engine.runner.piecewise is not None
    got, runs = _drive(engine)
    assert none == 0 and runs >= 20, runs
    assert engine.runner.piecewise.num_graphs > 1
    assert got == want
    torch.cuda.empty_cache()


def test_negative_control_stale_padding_rows_change_bits(monkeypatch) -> None:
    from lockstep.engine import piecewise_graphs

    want, _ = _drive(_engine("random:smollm2-135m", piecewise=False))

    def stale_padding(ops, q, kv, meta, scale, window, out):
        out[: q.shape[0]].copy_(ops.attention(q, kv, meta, scale, window))

    monkeypatch.setattr(piecewise_graphs, "attend_into", stale_padding)
    got, runs = _drive(_engine("random:smollm2-135m", piecewise=True))
    assert runs >= 20
    assert got != want
