"""Property-based API testing of the server with schemathesis.

Schemathesis reads the server's own OpenAPI schema and sends generated requests, valid and
invalid, to every operation of a real `lockstep serve` process, with every check it has on:
no 5xx; statuses, content types, headers and bodies as the schema documents them; invalid
data refused; a method a route does not take refused. One check is narrowed: a schema-valid
body may be refused, but only with a 400 for a rule JSON Schema cannot state (fields that
need or exclude each other, token ids against the vocabulary, the prompt against the
context: `_refused_for_a_rule_the_schema_cannot_state`), never for a type, a range or a field
the schema declares. The server must stay healthy and leave no KV slot in use. Bodies are bounded by a
hook (a few generated tokens, at most two choices and three prompts, the served model name most
of the time) so that the run stays well under three minutes on two CPU cores.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance
from test_server import ServerProcess

from lockstep.server.protocol import INT64_MAX

SERVE_ARGS = [
    "--device", "cpu",
    "--kv-tokens", "2048",
    "--max-batch-tokens", "256",
    "--chunk-size", "128",
    "--max-running", "16",
    "--max-model-len", "256",
    "--debug-checks",
]  # fmt: skip
MAX_EXAMPLES = 60


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    proc = ServerProcess(SERVE_ARGS).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


def _bounded(body: Any, model: str, path: str) -> Any:
    """Keeps a generated body cheap to serve without making it valid: types are left alone
    unless they are the ones bounded here."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    # A random model name is refused at once (404): use the real one unless it is absent,
    # so that the engine paths behind the model check are exercised too.
    if isinstance(body.get("model"), str) and not body["model"].startswith("x"):
        body["model"] = model
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], 3) if body[key] > 0 else body[key]
    # Left out, the limit is 16 tokens (completions) or the whole context (chat).
    limits = ("max_tokens", "max_completion_tokens")
    if path != "/v1/score" and all(body.get(key) is None for key in limits):
        body["max_tokens"] = 3
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], 2)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:3]
    if isinstance(prompt, str):
        body["prompt"] = prompt[:200]
    return body


# The RL control routes change what every other operation meets (a pause makes generation
# wait for a continue; a group join waits for a trainer to join): fuzzed between the others
# they would stall the run. tests/server/test_server_rl_*.py drive them, bad input included.
RL_CONTROL = ["/pause_generation", "/continue_generation", "/init_weights_update_group",
              "/update_weights_from_distributed", "/destroy_weights_update_group",
              "/release_memory_occupation", "/resume_memory_occupation", "/sleep",
              "/wake_up", "/update_weights_from_tensor"]  # fmt: skip
schema = schemathesis.pytest.from_fixture("api_schema").exclude(path=RL_CONTROL)


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_server_errors(case: Any, fuzz_server: ServerProcess) -> None:
    # Bounded here rather than in a `map_body` hook, which not every generation phase runs.
    case.body = _bounded(case.body, fuzz_server.model, case.path)
    response = case.call_and_validate(timeout=60, excluded_checks=[positive_data_acceptance])
    assert response.status_code < 500, (case.path, case.body, response.text)
    if response.status_code >= 400:
        # Every refusal has an OpenAI-style body.
        error = response.json()["error"]
        assert error["message"] and error["type"], response.text
    if case.meta is not None and case.meta.generation.mode.is_positive:
        if response.status_code == 400:
            assert _refused_for_a_rule_the_schema_cannot_state(error), (case.body, error)
        else:
            assert response.status_code in (200, 404, 429), (case.body, response.text)


# Codes of refusals for rules beyond a JSON Schema (docs/server.md, Errors): fields that need
# or exclude each other, values checked against the model (vocabulary, context), a message's
# fields that depend on its role. A schema-valid body refused with another code (an unknown
# field) or with pydantic's own range message would be the schema's fault. Two exceptions,
# neither the server's: JSON Schema's `integer` admits 1.0, which the server, like OpenAI's,
# refuses as a decimal number; and schemathesis judges validity through floats, so it takes
# an integer just past 2**63 - 1 (the schema's maximum) for one within it.
_RULE_CODES = {"invalid_value", "missing", "context_length_exceeded"}
# Supported only in combination with another field: best_of must equal n (the server does not
# rank candidates), which a schema cannot say since n varies.
_UNSUPPORTED_COMBINATIONS = {"best_of"}
_GOT_INTEGER = re.compile(r"\(got (-?[0-9]+)\)$")
_NOT_AN_INTEGER = re.compile(r"Input should be a valid integer \(got (-?[0-9.]+(e[-+]?[0-9]+)?)\)$")


def _refused_for_a_rule_the_schema_cannot_state(error: dict) -> bool:
    message = error["message"]
    if error["code"] == "invalid_type":
        got = _NOT_AN_INTEGER.search(message)
        literal = got.group(1) if got else ""
        return ("." in literal or "e" in literal) and float(literal).is_integer()
    pydantic_range = message.startswith("Invalid value for") and "(got " in message
    if pydantic_range and (got := _GOT_INTEGER.search(message)):
        return float(int(got.group(1))) == float(INT64_MAX)  # past the bound in float only
    if error["code"] == "unsupported_parameter":
        return error.get("param") in _UNSUPPORTED_COMBINATIONS
    return error["code"] in _RULE_CODES and not pydantic_range


def test_healthy_and_pool_free_after_fuzzing(fuzz_server: ServerProcess) -> None:
    assert httpx.get(fuzz_server.base_url + "/health").json() == {"status": "ok"}
    stats = fuzz_server.wait_idle()
    assert stats["kv_in_use"] == 0
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
