"""The typed wire between the HTTP process and the engine loop: every command, event and
start-up message as a frozen dataclass, in one place.

    front end (async_engine.py)  --- Command --->  engine loop (engine_loop.py)
                                 <--- Event -----
    EngineProcess (parent)       <--- Ready | StartFailed ---  engine process, once at start

The same objects cross a `multiprocessing` pipe (engine_process.py, pickled) or stay in one
process (engine_loop.EngineThread). Two rules keep the sides in step:

* A message pickles as its class, its field names and its values (`WireMessage.__reduce__`);
  unpickling rebuilds it through the constructor after checking that the receiver's class
  has exactly those fields, so a field added on one side and not the other raises
  `WireMismatch` naming both field lists, instead of arriving missing or ignored.
* A step's outputs cross as `PackedOutputs`: one tuple per `StepOutput`, in the order of
  `StepOutput`'s own dataclass fields, sent with those field names and checked against the
  receiver's on unpacking. Tuples because a step may carry hundreds of outputs and a pickled
  dataclass per output costs several times a tuple to rebuild, on the HTTP process's reader
  thread; the names because a tuple alone would let a new field shift the rest silently.
  A field whose value is no plain data (logprob records, the routed-experts array) has a
  codec in `_OUTPUT_CODECS`; everything else crosses as it is.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lockstep.engine.outputs import StepOutput, TokenLogprob

if TYPE_CHECKING:  # the engine's types, never imported at run time by the HTTP process
    from lockstep.engine.sampling_params import SamplingParams


class WireMismatch(RuntimeError):
    """A message's fields differ between the side that sent it and the side that read it."""


def _rebuild(cls: type, names: tuple[str, ...], values: tuple) -> Any:
    """Unpickle a `WireMessage`: `cls(*values)` once the receiver's fields are `names`."""
    expected = tuple(f.name for f in dataclasses.fields(cls))
    if names != expected:
        raise WireMismatch(
            f"{cls.__name__} was sent with fields {names}, but this side's {cls.__name__} has "
            f"{expected}: both processes must run the same Lockstep"
        )
    return cls(*values)


class WireMessage:
    """Base of every message: pickles by field names and values (see the module docstring)."""

    def __reduce__(self) -> tuple:
        names = tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]
        return _rebuild, (type(self), names, tuple(getattr(self, n) for n in names))


# -- commands (front end -> engine loop) --------------------------------------------------


@dataclass(frozen=True)
class AddRequests(WireMessage):
    """Add the requests, all or none (a `RequestError` for one is the reply's error and none
    was added). `stream`: their client reads tokens as they come."""

    call_id: int
    requests: list[tuple[str, list[int], SamplingParams]]  # (request_id, prompt ids, params)
    namespace: str | None
    stream: bool = False


@dataclass(frozen=True)
class Abort(WireMessage):
    """Free the requests' slots; no further output for them. No reply."""

    request_ids: list[str]


@dataclass(frozen=True)
class Finish(WireMessage):
    """Abort the requests (None: all), each with its closing output. No reply."""

    request_ids: list[str] | None


@dataclass(frozen=True)
class Call(WireMessage):
    """A named engine call (`engine_loop.ENGINE_CALLS`); its value is the reply's."""

    call_id: int
    name: str
    args: tuple = ()


@dataclass(frozen=True)
class Pause(WireMessage):
    """Stop stepping: "abort" | "retract" | "in_place" (engine_loop.EngineLoop._pause)."""

    call_id: int
    mode: str


@dataclass(frozen=True)
class Continue(WireMessage):
    """Step again after a `Pause`."""

    call_id: int


@dataclass(frozen=True)
class ReleaseMemory(WireMessage):
    """Free the KV pool's and/or the weights' memory (None: both; memory_occupation.py)."""

    call_id: int
    tags: list[str] | None


@dataclass(frozen=True)
class ResumeMemory(WireMessage):
    """Take released memory again (None: all of it)."""

    call_id: int
    tags: list[str] | None


@dataclass(frozen=True)
class Stop(WireMessage):
    """Abort whatever runs and end the loop."""


Command = (
    AddRequests | Abort | Finish | Call | Pause | Continue | ReleaseMemory | ResumeMemory | Stop
)
# The commands answered by a `Reply` with their `call_id`.
CALL_COMMANDS = (AddRequests, Call, Pause, Continue, ReleaseMemory, ResumeMemory)


# -- events (engine loop -> front end) ----------------------------------------------------


@dataclass(frozen=True)
class Outputs(WireMessage):
    """What a step produced (`step_seconds` None: closing outputs of aborted requests, or the
    step a pause completed, which are not timed steps)."""

    outputs: list[StepOutput]
    step_seconds: float | None
    new_tokens: int


@dataclass(frozen=True)
class Reply(WireMessage):
    """The answer to a call command: its value, or the exception it raised."""

    call_id: int
    value: Any
    error: BaseException | None


@dataclass(frozen=True)
class StepFailed(WireMessage):
    """A step raised; the requests in flight were aborted."""

    message: str
    request_ids: list[str]


@dataclass(frozen=True)
class Fatal(WireMessage):
    """The engine cannot compute another step."""

    message: str


Event = Outputs | Reply | StepFailed | Fatal


# -- start-up (engine process -> parent, once) --------------------------------------------


@dataclass(frozen=True)
class EngineInfo(WireMessage):
    """What the front end reads about the engine once, at start-up (`Ready` carries it)."""

    model_name: str
    tokenizer: Any
    max_model_len: int
    config: Any  # the EngineConfig
    kv_slots: int  # the KV pool's slots: a sequence never holds more
    fingerprint: dict[str, Any]  # Engine.fingerprint() at start
    model_type: str | None  # the model family (SGLang's /model_info)
    model_vocab_size: int  # the logits' width (structured outputs' masks)
    tokenizer_path: str | None  # a Hugging Face tokenizer folder (tokenizer_folder.py)
    detokenizes: bool  # outputs carry text (False: the front end makes it, output_text.py)

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        from lockstep.models.tokenizer import Tokenizer
        from lockstep.models.tokenizer_folder import tokenizer_folder
        from lockstep.ops.cpu_build import cache_root

        decoder = getattr(engine, "decoder", None)
        loaded = getattr(engine, "loaded", None)
        tokenizer_path = None
        if loaded is not None and isinstance(engine.tokenizer, Tokenizer):
            # The model's own folder, or one written into Lockstep's cache for a GGUF file or
            # preset (what SGLang's routers load).
            tokenizer_path = tokenizer_folder(
                engine.tokenizer, loaded.source, engine.max_model_len, cache_root()
            )
        return cls(
            model_name=engine.model_name,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            config=engine.config,
            kv_slots=engine.pool.num_slots,
            fingerprint=engine.fingerprint(),
            model_type=None if decoder is None else decoder.spec.family,
            model_vocab_size=engine.tokenizer.vocab_size
            if decoder is None
            else decoder.spec.vocab_size,
            tokenizer_path=tokenizer_path,
            detokenizes=getattr(engine, "detokenize", True),
        )


@dataclass(frozen=True)
class Ready(WireMessage):
    """The engine loaded."""

    info: EngineInfo


@dataclass(frozen=True)
class StartFailed(WireMessage):
    """The engine could not load: the one line the user sees, and `lockstep serve`'s exit
    status (2: a bad option or model; 1: anything else)."""

    message: str
    exit_status: int


# -- a step's outputs across the pipe -----------------------------------------------------

STEP_OUTPUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StepOutput))


@dataclass(frozen=True)
class PackedOutputs(WireMessage):
    """`Outputs` as the engine process sends them: `rows[i]` holds output i's values in the
    order of `fields` (the sender's `STEP_OUTPUT_FIELDS`)."""

    fields: tuple[str, ...]
    rows: list[tuple]
    step_seconds: float | None
    new_tokens: int


def _logprob_to_wire(lp: TokenLogprob | None) -> tuple | None:
    return None if lp is None else (lp.token_id, lp.logprob, lp.top)


def _logprob_from_wire(t: tuple | None) -> TokenLogprob | None:
    return None if t is None else TokenLogprob(*t)


def _logprobs_to_wire(lps: list[TokenLogprob | None] | None) -> list | None:
    return None if lps is None else [_logprob_to_wire(lp) for lp in lps]


def _logprobs_from_wire(wire: list | None) -> list[TokenLogprob | None] | None:
    return None if wire is None else [_logprob_from_wire(t) for t in wire]


def _routed_to_wire(routed: np.ndarray | None) -> tuple[bytes, tuple[int, ...]] | None:
    """Routed experts cross as their int32 bytes and shape (data, never a pickled array)."""
    return None if routed is None else (routed.astype("<i4").tobytes(), routed.shape)


def _routed_from_wire(wire: tuple[bytes, tuple[int, ...]] | None) -> np.ndarray | None:
    if wire is None:
        return None
    data, shape = wire
    return np.frombuffer(data, dtype="<i4").reshape(shape).astype(np.int32)


# The `StepOutput` fields that are not plain data: (to the wire, from the wire).
_OUTPUT_CODECS = {
    "new_logprobs": (_logprobs_to_wire, _logprobs_from_wire),
    "prompt_logprobs": (_logprobs_to_wire, _logprobs_from_wire),
    "routed_experts": (_routed_to_wire, _routed_from_wire),
}
_unknown = set(_OUTPUT_CODECS) - set(STEP_OUTPUT_FIELDS)
if _unknown:  # a renamed StepOutput field whose codec was left behind
    raise WireMismatch(f"codecs for fields StepOutput does not have: {sorted(_unknown)}")


_values = operator.attrgetter(*STEP_OUTPUT_FIELDS)
# (position in a row, to the wire, from the wire) of each field with a codec.
_CODED = tuple((STEP_OUTPUT_FIELDS.index(name), *codec) for name, codec in _OUTPUT_CODECS.items())


def pack_outputs(event: Outputs) -> PackedOutputs:
    """`event` as the engine process sends it (tuples of data, see the module docstring)."""
    rows = []
    for output in event.outputs:
        row = list(_values(output))
        for i, to_wire, _ in _CODED:
            row[i] = to_wire(row[i])
        rows.append(tuple(row))
    return PackedOutputs(STEP_OUTPUT_FIELDS, rows, event.step_seconds, event.new_tokens)


def unpack_outputs(packed: PackedOutputs) -> Outputs:
    """The `Outputs` the engine sent; `WireMismatch` if its `StepOutput` has other fields."""
    if packed.fields != STEP_OUTPUT_FIELDS:
        raise WireMismatch(
            f"StepOutput was sent with fields {packed.fields}, but this side's StepOutput has "
            f"{STEP_OUTPUT_FIELDS}: both processes must run the same Lockstep"
        )
    outputs = []
    for values in packed.rows:
        row = list(values)
        for i, _, from_wire in _CODED:
            row[i] = from_wire(row[i])
        outputs.append(StepOutput(*row))
    return Outputs(outputs, packed.step_seconds, packed.new_tokens)
