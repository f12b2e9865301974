"""Text made outside the engine (lockstep/server/output_text.py) equals the engine's own:
the same requests (stop strings kept and cut, min_tokens, stop tokens hidden, aborts mid-way) on an
engine that makes its text and on one that sends token ids only, whose outputs go through
`OutputText` as the server's HTTP process feeds them, give the same text, tokens, finish
reasons and stop reasons. Control: the engine without text runs past the stop strings (the
cut is OutputText's doing). The same holds when the engine process holds the outputs of
requests answered whole (lockstep/server/held_outputs.py) and sends them merged."""

from __future__ import annotations

from typing import Any

import pytest

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.server.held_outputs import HeldOutputs
from lockstep.server.output_text import OutputText

STEPS_BEFORE_ABORT = 6


def _params() -> list[SamplingParams]:
    params = []
    for i in range(24):
        stop: tuple[str, ...] = (("_45", "\n"), ("nused_39",), ("<|", "9"), ())[i % 4]
        params.append(SamplingParams(
            max_tokens=10 + i % 5, temperature=1.0, seed=i, stop=stop,
            include_stop_str_in_output=i % 3 == 0, min_tokens=(0, 2, 5)[i % 3],
            ignore_eos=i % 2 == 0,
            # Stop tokens (the random model writes many `<|unused_N|>`): their text is hidden.
            stop_token_ids=tuple(range(256, 512)) if i % 4 == 3 else (),
        ))  # fmt: skip
    return params


def _prompt(i: int) -> list[int]:
    return [(13 * i + 5 * j) % 250 + 3 for j in range(3 + i % 7)]


def _run(
    engine: Engine, with_output_text: bool, abort: set[int], held: HeldOutputs | None = None
) -> dict[int, dict[str, Any]]:
    params = _params()
    results: dict[int, dict[str, Any]] = {}
    texts: dict[str, OutputText] = {}
    for i, p in enumerate(params):
        rid = f"r{i}"
        engine.add_request(rid, _prompt(i), p)
        if held is not None:
            held.track(rid, p, stream=False)
        results[i] = {"text": "", "ids": [], "finish": None, "stop": None}
        if with_output_text:
            texts[rid] = OutputText(engine.tokenizer, _prompt(i), p)
    steps = 0

    def take(out: Any) -> None:
        r = results[int(out.request_id[1:])]
        if r["finish"] is not None:
            return  # ended by OutputText: the server drops the engine's later outputs
        if with_output_text and texts[out.request_id].fill(out):
            engine.abort_request(out.request_id)  # what the HTTP process sends
        r["text"] += out.new_text
        r["ids"] += out.new_token_ids
        if out.finished:
            r["finish"], r["stop"] = out.finish_reason, out.stop_reason

    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs if held is None else held.pass_on(outputs):
            take(out)
        steps += 1
        if steps == STEPS_BEFORE_ABORT:
            for i in sorted(abort):
                closing = engine.abort_request(f"r{i}")
                if held is not None:
                    closing = held.close(f"r{i}", closing)
                if closing is not None:
                    take(closing)
    engine.check_integrity()
    return results


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    config = EngineConfig.from_options(model="random:tiny", device="cpu", kv_tokens=4096)
    return Engine(config), Engine(config, detokenize=False)


def test_text_made_outside_the_engine_is_the_engines(engines: tuple[Engine, Engine]) -> None:
    with_text, without_text = engines
    abort = {5, 10, 17}
    expected = _run(with_text, with_output_text=False, abort=abort)
    got = _run(without_text, with_output_text=True, abort=abort)
    assert got == expected
    reasons = {r["finish"] for r in expected.values()}
    assert {"stop", "length", "abort"} <= reasons, reasons
    assert any(isinstance(r["stop"], str) for r in expected.values())
    # Control: the engine that makes no text ends no request on a stop string.
    raw = _run(without_text, with_output_text=False, abort=abort)
    cut = [i for i, r in expected.items() if isinstance(r["stop"], str)]
    assert all(raw[i]["ids"][: len(expected[i]["ids"])] == expected[i]["ids"] for i in cut)
    assert any(len(raw[i]["ids"]) > len(expected[i]["ids"]) for i in cut)
    assert all(raw[i]["text"] == "" for i in raw)


def test_held_outputs_give_the_same_answers(engines: tuple[Engine, Engine]) -> None:
    """Outputs of requests without stop strings held in the engine process and sent merged
    (their first as it comes, the rest when they end or are aborted) give the text, tokens
    and finish of every output sent as it comes; requests with stop strings are not held."""
    with_text, without_text = engines
    abort = {5, 10, 17}
    expected = _run(with_text, with_output_text=False, abort=abort)
    held = HeldOutputs()
    sent = []
    pass_on = held.pass_on

    def counting(outputs):
        out = pass_on(outputs)
        sent.extend(o.request_id for o in out)
        return out

    held.pass_on = counting  # type: ignore[method-assign]
    assert _run(without_text, with_output_text=True, abort=abort, held=held) == expected
    # Requests 3, 7, ... have no stop strings: at most two outputs each (the first, then the
    # rest), where the others were sent one a token.
    held_ids = [i for i in range(3, 24, 4) if i not in abort]
    assert all(1 <= sent.count(f"r{i}") <= 2 for i in held_ids)
    assert any(len(expected[i]["ids"]) > 2 for i in held_ids)
    unheld = [i for i, p in enumerate(_params()) if p.stop]
    assert sum(sent.count(f"r{i}") for i in unheld) > 2 * len(unheld)
    assert len(held) == 0


def test_negative_control_held_outputs_that_are_not_merged(
    engines: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held outputs replaced instead of merged (each later one dropping those before it):
    the comparison above sees the lost tokens."""
    from lockstep.server import held_outputs

    merged = held_outputs._merged
    monkeypatch.setattr(held_outputs, "_merged", lambda held, out: merged(None, out))
    with_text, without_text = engines
    expected = _run(with_text, with_output_text=False, abort=set())
    got = _run(without_text, with_output_text=True, abort=set(), held=HeldOutputs())
    assert got != expected
