"""A real `lockstep serve --speculative ngram` (the embedded model on the CPU) answers what plain
decode computes (docs/speculative.md): the text, every token's logprob, the finish reason,
streamed and whole, greedy and seeded, a stop string found in the HTTP process while the engine
verifies several tokens a step; and it reports speculation's counters in /metrics and
GET /v1/engine. The reference is an in-process engine without speculation.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from lockstep import LLM, SamplingParams
from tests.server.test_server import SERVE_ARGS, ServerProcess

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, lit the lamp and watched the ships pass."
)
PROMPT = f"Repeat the following text exactly.\n\nText: {PARAGRAPH}\n\nCopy: The old"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess([*SERVE_ARGS, "--speculative", "ngram"]).start()
    yield proc
    proc.stop()


def test_speculating_server_answers_as_plain_decode(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    plain = LLM(device="cpu", kv_tokens=1024)
    greedy = plain.generate([PROMPT], SamplingParams(max_tokens=32, temperature=0),
                            use_tqdm=False)[0]  # fmt: skip
    stop = greedy.text[len(greedy.text) // 2 :][:5]
    cases = [
        {"temperature": 0.0},
        {"temperature": 0.8, "seed": 11},
        {"temperature": 0.0, "stop": [stop]},
    ]
    for case in cases:
        want = plain.generate([PROMPT], SamplingParams(max_tokens=32, logprobs=1, **case),
                              use_tqdm=False)[0]  # fmt: skip
        args = dict(model=server.model, prompt=PROMPT, max_tokens=32, logprobs=1, **case)
        whole = client.completions.create(**args).choices[0]
        assert whole.text == want.text, case
        assert whole.logprobs.token_logprobs == want.logprobs, case
        assert whole.finish_reason == want.finish_reason, case
        chunks = list(client.completions.create(**args, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want.text, case
        streamed = [x for c in chunks if c.choices[0].logprobs
                    for x in c.choices[0].logprobs.token_logprobs]  # fmt: skip
        assert streamed == want.logprobs, case
    assert want.finish_reason == "stop" and stop not in want.text

    stats = server.wait_idle()
    assert stats["spec_accepted_tokens_total"] > 0 and stats["spec_acceptance_rate"] > 0
    config = httpx.get(server.base_url + "/v1/engine", timeout=30).json()["config"]
    assert config["speculative"] == "ngram" and config["overlap_decode"] is False
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    accepted = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("lockstep_spec_accepted_tokens_total ")
    )
    assert accepted == stats["spec_accepted_tokens_total"]
    assert "lockstep_spec_acceptance_rate" in metrics
    assert stats["kv_in_use"] == 0 and stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
