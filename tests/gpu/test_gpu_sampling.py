"""Logits processing and structured outputs on the GPU (bfloat16, CUDA graphs, overlapped
decode): the processed rows equal the CPU's bit for bit, and requests with penalties and
grammars mixed with plain ones give the tokens and logprobs they get alone, with and without
CUDA graphs (processing runs eagerly after the graph's forward). The control: reference mode
differs. Runs only where CUDA is present."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = "random:smollm2-135m"


def test_processed_rows_on_cuda_equal_the_cpu() -> None:
    from lockstep.engine.logits_processing import process_logits
    from tests.unit.engine.test_logits_processing import _logits, _random_request

    for seed in range(20):
        rng = random.Random(seed)
        requests = [_random_request(rng) for _ in range(16)]
        logits = _logits(rng, len(requests))
        cpu = process_logits(logits, requests)
        gpu = process_logits(logits.cuda(), requests).cpu()
        assert torch.equal(cpu.view(torch.int32), gpu.view(torch.int32)), seed


def _params(i: int):
    from lockstep.engine.sampling_params import SamplingParams
    from lockstep.engine.structured_output import StructuredOutput

    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "tag": {"type": "string", "maxLength": 12}},
        "required": ["id", "tag"], "additionalProperties": False,
    }  # fmt: skip
    kinds = [
        {},
        {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
        {"structured_output": StructuredOutput.json_schema(schema)},
        {"logit_bias": {11: 4.0, 200: -50.0}, "min_tokens": 8, "bad_words": ("the",)},
        {"structured_output": StructuredOutput.regex("[a-z ]{4,60}"), "presence_penalty": 0.5},
    ]
    return SamplingParams(max_tokens=48, temperature=0.0 if i % 2 else 1.0, seed=i,
                          logprobs=0 if i % 3 == 0 else None, **kinds[i % len(kinds)])  # fmt: skip


def _run(mode: str, graphs: bool, batch: list[int]) -> dict:
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    engine = Engine(EngineConfig(model=MODEL, mode=mode, device="cuda", dtype="bfloat16",
                                 kv_tokens=16384, max_model_len=2048, max_running=16,
                                 cuda_graphs=graphs))  # fmt: skip
    rng = random.Random(2)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(4, 200))] for _ in range(14)]
    results = {}
    for group in ([batch], [[i] for i in batch]):  # together, then each alone
        for members in group:
            for i in members:
                engine.add_request(f"r{i}-{len(members)}", prompts[i], _params(i))
            while engine.has_unfinished():
                for out in engine.step():
                    rid = out.request_id.split("-")[0]
                    key = (rid, len(members) > 1)
                    results.setdefault(key, []).append((out.new_token_ids, out.new_token_logprobs))
            engine.flush_cache()
    if graphs:
        assert engine.runner.graphs.num_graphs > 0
    del engine
    torch.cuda.empty_cache()
    return results


def test_mixed_processing_batches_match_alone_with_and_without_graphs() -> None:
    batch = list(range(14))
    runs = {graphs: _run("deterministic", graphs, batch) for graphs in (True, False)}
    for graphs, results in runs.items():
        for i in batch:
            assert results[(f"r{i}", True)] == results[(f"r{i}", False)], (graphs, i)
    assert runs[True] == runs[False]
    # The JSON requests' outputs parse (the grammar held under graphs).
    from lockstep.models.resolver import resolve_model

    tok = resolve_model(MODEL).tokenizer
    for i in batch[2::5]:
        ids = [t for step in runs[True][(f"r{i}", True)] for t in step[0]]
        json.loads(tok.decode(ids))


def test_negative_control_reference_mode_batches_differ() -> None:
    results = _run("reference", True, list(range(14)))
    assert any(results[(f"r{i}", True)] != results[(f"r{i}", False)] for i in range(14))
