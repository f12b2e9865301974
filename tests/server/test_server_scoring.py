"""Scoring through `/v1/completions`, as evaluation harnesses do it, on a real server.

`echo` with `max_tokens: 0` and `logprobs` returns the prompt's logprobs and generates
nothing; by the engine's contract they are bit for bit `/v1/score`'s and those the same
tokens got when generated. vLLM's `prompt_logprobs` and `return_tokens_as_token_ids` are
checked against the same numbers, and lm-evaluation-harness's own requests
(`lm_eval/models/openai_completions.py`, `local-completions`) are sent as it sends them.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import test_server
from test_server import ServerProcess

# test_server.py's fixtures: a server of this module's own, and a kept-alive client.
server, http = test_server.server, test_server.http


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _ids(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def _score(http: httpx.Client, model: str, ids: list[int], top: int = 0) -> dict:
    response = http.post("/v1/score", json={"model": model, "prompt": ids, "top_logprobs": top})
    assert response.status_code == 200, response.text
    return response.json()["data"][0]


def test_echo_without_generation_equals_score_and_generation_bitwise(
    client: openai.OpenAI, server: ServerProcess, http: httpx.Client
) -> None:
    prompt = _ids(http, "A short poem about rivers:")
    gen = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=10, temperature=0.8, seed=7, logprobs=2,
        extra_body={"return_token_ids": True},
    ).model_dump()["choices"][0]  # fmt: skip
    full = prompt + gen["token_ids"]
    echoed = client.completions.create(
        model=server.model, prompt=full, max_tokens=0, echo=True, logprobs=2
    )
    choice = echoed.choices[0]
    lp = choice.logprobs
    assert choice.finish_reason == "length"
    assert echoed.usage.completion_tokens == 0 and echoed.usage.prompt_tokens == len(full)
    assert len(lp.tokens) == len(full) and lp.token_logprobs[0] is None
    assert choice.text == http.post("/detokenize", json={"tokens": full}).json()["prompt"]

    scored = _score(http, server.model, full, top=2)
    assert lp.token_logprobs == scored["logprobs"]  # the engine's own bits, through JSON
    score_top = [None] + [
        {e["token"]: e["logprob"] for e in row} for row in scored["top_logprobs"][1:]
    ]
    assert lp.top_logprobs == score_top
    n = len(prompt)
    assert lp.token_logprobs[n:] == gen["logprobs"]["token_logprobs"]
    assert lp.top_logprobs[n:] == gen["logprobs"]["top_logprobs"]
    # The control: one position off, the same comparison fails.
    assert lp.token_logprobs[n - 1 : -1] != gen["logprobs"]["token_logprobs"]

    streamed = list(
        client.completions.create(
            model=server.model, prompt=full, max_tokens=0, echo=True, logprobs=2, stream=True
        )
    )
    assert [c.choices[0].logprobs.token_logprobs for c in streamed] == [lp.token_logprobs]
    assert streamed[-1].choices[0].finish_reason == "length"


def test_lm_eval_harness_requests(server: ServerProcess, http: httpx.Client) -> None:
    """lm-evaluation-harness's `local-completions`: loglikelihood requests score token-id
    prompts with max_tokens 1 and echo, summing `token_logprobs[ctxlen:-1]` (the last entry
    is the generated token) and calling the continuation greedy when each of its tokens
    has the top logprob; generation requests are plain completions with `stop`."""
    context = _ids(http, "The capital of France is")
    greedy = http.post("/v1/completions", json={
        "model": server.model, "prompt": context, "max_tokens": 3, "temperature": 0,
        "return_token_ids": True,
    }).json()["choices"][0]["token_ids"]  # fmt: skip
    other = _ids(http, " a lovely city")
    payload = {
        "model": server.model, "prompt": [context + greedy, context + other],
        "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True,
    }  # fmt: skip
    response = http.post("/v1/completions", json=payload)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    results = []
    for choice in choices:
        token_logprobs = choice["logprobs"]["token_logprobs"][len(context) : -1]
        top_logprobs = choice["logprobs"]["top_logprobs"][len(context) : -1]
        is_greedy = all(
            t == max(top.values()) for t, top in zip(token_logprobs, top_logprobs, strict=True)
        )
        results.append((sum(token_logprobs), is_greedy))
    for (total, _), continuation in zip(results, (greedy, other), strict=True):
        scored = _score(http, server.model, context + continuation)["logprobs"]
        assert total == sum(scored[len(context) :])
    assert [greedy_flag for _, greedy_flag in results] == [True, False]

    generation = http.post("/v1/completions", json={
        "prompt": ["Count: 1, 2, 3,"], "model": server.model, "max_tokens": 8,
        "temperature": 0, "stop": ["\n\n", "<|im_end|>"], "seed": 1234,
    })  # fmt: skip
    assert generation.status_code == 200, generation.text
    assert [c["index"] for c in generation.json()["choices"]] == [0]


def test_prompt_logprobs_in_vllm_shape(server: ServerProcess, http: httpx.Client) -> None:
    prompt = _ids(http, "Lockstep scores every prompt token.")
    scored = _score(http, server.model, prompt, top=3)
    body = http.post("/v1/completions", json={
        "model": server.model, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3,
    }).json()  # fmt: skip
    positions = body["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(prompt) and positions[0] is None
    for p in range(1, len(prompt)):
        entry = positions[p]
        keys = list(entry)
        assert keys[0] == str(prompt[p])  # the prompt token first
        assert entry[keys[0]]["logprob"] == scored["logprobs"][p]
        top = scored["top_logprobs"][p]
        for rank, alternative in enumerate(top, start=1):
            got = entry[str(alternative["token_id"])]
            assert (got["logprob"], got["rank"]) == (alternative["logprob"], rank)
        in_top = [a["token_id"] for a in top]
        expected_rank = in_top.index(prompt[p]) + 1 if prompt[p] in in_top else None
        assert entry[keys[0]]["rank"] == expected_rank
        assert len(entry) == 3 + (prompt[p] not in in_top)
    decoded = http.post("/detokenize", json={"tokens": [prompt[1]]}).json()["prompt"]
    assert positions[1][str(prompt[1])]["decoded_token"] == decoded

    # Chat: one list on the response, for the prompt every choice shares.
    chat = http.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0, "return_token_ids": True,
    }).json()  # fmt: skip
    chat_ids = chat["choices"][0]["prompt_token_ids"]
    chat_scored = _score(http, server.model, chat_ids)["logprobs"]
    got = [None] + [
        chat["prompt_logprobs"][p][str(t)]["logprob"] for p, t in enumerate(chat_ids) if p
    ]
    assert got == chat_scored
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0: the token alone


def test_return_tokens_as_token_ids(client: openai.OpenAI, server: ServerProcess) -> None:
    args = dict(model=server.model, prompt="Héllo wörld", max_tokens=4, temperature=0, logprobs=2)
    plain = client.completions.create(**args, echo=True).choices[0].logprobs
    as_ids = client.completions.create(
        **args, echo=True, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}
    ).model_dump()["choices"][0]
    ids = as_ids["prompt_token_ids"] + as_ids["token_ids"]
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert as_ids["logprobs"]["token_logprobs"] == plain.token_logprobs
    for named, by_id in zip(
        plain.top_logprobs[1:], as_ids["logprobs"]["top_logprobs"][1:], strict=True
    ):
        assert all(key.startswith("token_id:") for key in by_id)
        assert sorted(by_id.values()) == sorted(named.values())

    chat_args = dict(
        model=server.model, messages=[{"role": "user", "content": "Say ñ."}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    chat_plain = client.chat.completions.create(**chat_args).choices[0]
    chat_ids = client.chat.completions.create(
        **chat_args, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}
    ).model_dump()["choices"][0]
    content = chat_ids["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat_ids["token_ids"]]
    # The bytes stay the token's own, as in vLLM.
    assert [e["bytes"] for e in content] == [e.bytes for e in chat_plain.logprobs.content]


def test_n_with_best_of_equal_to_n(client: openai.OpenAI, server: ServerProcess) -> None:
    args = dict(model=server.model, prompt="Once", max_tokens=5, temperature=1.0, seed=3, n=2)
    with_best_of = client.completions.create(**args, best_of=2)
    without = client.completions.create(**args)
    assert [c.text for c in with_best_of.choices] == [c.text for c in without.choices]


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens", "echo"),
        ({"best_of": 3, "n": 2}, "best_of", "does not rank"),
        ({"best_of": 1, "n": 2}, "best_of", "at least n"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "0"),
    ],
)  # fmt: skip
def test_scoring_refusals(
    server: ServerProcess, http: httpx.Client, body: dict, param: str, needle: str
) -> None:
    response = http.post(
        "/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2, **body}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error
