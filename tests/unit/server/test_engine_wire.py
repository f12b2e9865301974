"""The typed wire between the HTTP process and the engine loop (lockstep/server/engine_wire.py):
every message crosses the pipe the engine process uses (a spawn-context `multiprocessing`
pipe, pickled) and arrives equal; a step's outputs cross packed and arrive as the same
`StepOutput`s; a message or an output whose fields differ between the two sides fails loudly
with `WireMismatch` instead of arriving with a field missing or shifted."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
from collections.abc import Iterator

import numpy as np
import pytest

from lockstep.engine.outputs import StepOutput, TokenLogprob
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import RequestError
from lockstep.server import engine_wire as wire


def _step_output(i: int, *, full: bool) -> StepOutput:
    """An output with every field set to a value of its own (`full`), or the defaults."""
    if not full:
        return StepOutput(f"r{i}", [i], "", None, False, None, 3, 0, 1, i)
    return StepOutput(
        request_id=f"r{i}",
        new_token_ids=[i, i + 1],
        new_text="hi",
        new_logprobs=[TokenLogprob(i, -0.5, ((i, -0.5), (7, -1.25))), TokenLogprob(9, -2.0)],
        finished=True,
        finish_reason="stop",
        prompt_tokens=5,
        cached_tokens=2,
        completion_tokens=2,
        seed=1234 + i,
        prompt_logprobs=[None, TokenLogprob(3, -0.75)],
        stop_reason="</s>",
        new_token_logprobs=[-0.5, -2.0],
        hides_token=True,
        routed_experts=np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2) + i,
    )


def _info() -> wire.EngineInfo:
    return wire.EngineInfo(
        model_name="random:tiny", tokenizer=None, max_model_len=64, config=None, kv_slots=128,
        fingerprint={"weight_version": "default"}, model_type="qwen3", model_vocab_size=256,
        tokenizer_path=None, detokenizes=False,
    )  # fmt: skip


# One example of every message of the wire; `test_every_message_has_an_example` keeps the
# list whole as messages are added.
EXAMPLES: list[wire.WireMessage] = [
    wire.AddRequests(3, [("r1", [1, 2, 3], SamplingParams(max_tokens=4, seed=5))], "ns", True),
    wire.Abort(["r1", "r2"]),
    wire.Finish(None),
    wire.Finish(["r1"]),
    wire.Call(4, "update_weights_from_disk", ("/tmp/w", "v2")),
    wire.Pause(5, "retract"),
    wire.Continue(6),
    wire.ReleaseMemory(7, ["kv_cache"]),
    wire.ResumeMemory(8, None),
    wire.Stop(),
    wire.Outputs([_step_output(0, full=False)], 0.125, 1),
    wire.Reply(9, {"weight_version": "v2"}, None),
    wire.StepFailed("RuntimeError: boom", ["r1"]),
    wire.Fatal("the engine process died"),
    wire.Ready(_info()),
    _info(),
    wire.StartFailed("model=nope is invalid", 2),
    wire.PackedOutputs(wire.STEP_OUTPUT_FIELDS, [], None, 0),
]


def _message_classes() -> set[type]:
    return {
        cls
        for cls in vars(wire).values()
        if isinstance(cls, type)
        and issubclass(cls, wire.WireMessage)
        and cls is not wire.WireMessage
    }


def test_every_message_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == _message_classes()
    for cls in _message_classes():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls


@pytest.fixture(scope="module")
def pipe() -> Iterator[tuple]:
    """The engine process's pipe: a spawn-context `multiprocessing.Pipe`."""
    parent, child = mp.get_context("spawn").Pipe()
    yield parent, child
    parent.close()
    child.close()


def _through(pipe: tuple, message: object) -> object:
    parent, child = pipe
    parent.send(message)
    return child.recv()


def _equal_outputs(got: list[StepOutput], want: list[StepOutput]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for f in dataclasses.fields(StepOutput):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(y, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), f.name
            else:
                assert x == y and type(x) is type(y), f.name


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_each_message_round_trips_through_the_pipe(pipe: tuple, message: object) -> None:
    got = _through(pipe, message)
    assert type(got) is type(message)
    if isinstance(message, wire.Outputs):
        _equal_outputs(got.outputs, message.outputs)
        assert (got.step_seconds, got.new_tokens) == (message.step_seconds, message.new_tokens)
    else:
        assert got == message


def test_a_reply_error_crosses_as_the_exception_it_was(pipe: tuple) -> None:
    got = _through(pipe, wire.Reply(1, None, RequestError("prompt too long")))
    assert isinstance(got.error, RequestError) and str(got.error) == "prompt too long"


def test_a_steps_outputs_cross_packed_and_arrive_equal(pipe: tuple) -> None:
    outputs = [_step_output(i, full=i % 2 == 0) for i in range(6)]
    event = wire.Outputs(outputs, 0.01, 9)
    got = _through(pipe, wire.pack_outputs(event))
    assert isinstance(got, wire.PackedOutputs)
    # Plain data on the wire: no StepOutput, TokenLogprob or numpy array is pickled.
    assert b"StepOutput" not in pickle.dumps(got) and b"numpy" not in pickle.dumps(got)
    unpacked = wire.unpack_outputs(got)
    _equal_outputs(unpacked.outputs, outputs)
    assert (unpacked.step_seconds, unpacked.new_tokens) == (0.01, 9)
    # The control: the comparison sees a field's value.
    changed = [dataclasses.replace(outputs[0], seed=0), *outputs[1:]]
    with pytest.raises(AssertionError, match="seed"):
        _equal_outputs(unpacked.outputs, changed)


def test_a_message_field_added_on_one_side_fails_loudly(monkeypatch) -> None:
    """The sender's `Abort` has one field; the receiver's (the same class name, redefined
    with a field more) refuses it, naming both field lists."""
    sent = pickle.dumps(wire.Abort(["r1"]))

    @dataclasses.dataclass(frozen=True)
    class Abort(wire.WireMessage):
        request_ids: list[str]
        reason: str

    Abort.__module__, Abort.__qualname__ = wire.__name__, "Abort"
    monkeypatch.setattr(wire, "Abort", Abort)
    with pytest.raises(wire.WireMismatch, match=r"Abort was sent with fields \('request_ids',\)"):
        pickle.loads(sent)
    # And the other way: a field the receiver lacks.
    sent_wider = pickle.dumps(Abort(["r1"], "client gone"))
    monkeypatch.undo()
    with pytest.raises(wire.WireMismatch, match="'reason'"):
        pickle.loads(sent_wider)


def test_a_step_output_field_added_on_one_side_fails_loudly() -> None:
    packed = wire.pack_outputs(wire.Outputs([_step_output(0, full=True)], None, 0))
    wider = dataclasses.replace(
        packed, fields=(*packed.fields, "new_field"), rows=[(*packed.rows[0], 1)]
    )
    with pytest.raises(wire.WireMismatch, match="'new_field'"):
        wire.unpack_outputs(pickle.loads(pickle.dumps(wider)))
    narrower = dataclasses.replace(packed, fields=packed.fields[:-1], rows=[packed.rows[0][:-1]])
    with pytest.raises(wire.WireMismatch, match="StepOutput was sent with fields"):
        wire.unpack_outputs(narrower)


def test_the_packed_order_is_step_outputs_own() -> None:
    """Rows follow `StepOutput`'s dataclass fields, so a field added to `StepOutput` travels
    without a hand-written tuple to keep in step."""
    assert wire.STEP_OUTPUT_FIELDS == tuple(f.name for f in dataclasses.fields(StepOutput))
    output = _step_output(1, full=True)
    (row,) = wire.pack_outputs(wire.Outputs([output], None, 0)).rows
    assert len(row) == len(wire.STEP_OUTPUT_FIELDS)
    assert row[wire.STEP_OUTPUT_FIELDS.index("seed")] == output.seed


def test_messages_are_frozen_and_take_exactly_their_fields() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        wire.Pause(1, "abort").mode = "retract"  # type: ignore[misc]
    with pytest.raises(TypeError):
        wire.Pause(1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        wire.Abort(["r1"], reason="x")  # type: ignore[call-arg]
