"""The one `SamplingParams` builder (lockstep/server/sampling.py): the OpenAI and SGLang bodies
are read into the same fields and built by the same rules (seed per choice, stop lists, top_k
-1, error names), so the same knobs give the same `SamplingParams` on every route. Real
request models (pydantic, as the routes validate them); no server."""

from __future__ import annotations

import pytest

from lockstep.errors import RequestError
from lockstep.server.native_api import native_fields
from lockstep.server.native_protocol import NativeSamplingParams
from lockstep.server.preparation import openai_fields
from lockstep.server.protocol import APIError, CompletionRequest
from lockstep.server.sampling import SamplingFields, build_sampling_params

KNOBS = dict(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05, ignore_eos=True,
             skip_special_tokens=False, stop_token_ids=[5, 7])  # fmt: skip


def _openai(**keys: object) -> SamplingFields:
    body = CompletionRequest(model="m", prompt="hi", **{**KNOBS, **keys})  # type: ignore[arg-type]
    return openai_fields(body, max_tokens=12)


def _native(**keys: object) -> SamplingFields:
    return native_fields(NativeSamplingParams(max_new_tokens=12, **{**KNOBS, **keys}))  # type: ignore[arg-type]


def test_the_same_knobs_build_the_same_params_on_both_routes() -> None:
    openai = build_sampling_params(_openai(seed=40, stop=["x", "y"], include_stop_str_in_output=True),
                                   choice=2, logprobs=3)  # fmt: skip
    native = build_sampling_params(_native(sampling_seed=40, stop=["x", "y"], no_stop_trim=True),
                                   choice=2, logprobs=3)  # fmt: skip
    assert openai == native
    assert (openai.seed, openai.top_k, openai.stop) == (42, 0, ("x", "y"))  # seed + choice
    assert openai.include_stop_str_in_output and openai.stop_token_ids == (5, 7)
    # The control: one knob apart, the params differ.
    cooler = build_sampling_params(_native(sampling_seed=40, stop=["x", "y"], no_stop_trim=True,
                                           temperature=0.6), choice=2, logprobs=3)  # fmt: skip
    assert cooler != openai


def test_stop_strings_then_the_servers_own_each_once() -> None:
    params = build_sampling_params(_openai(stop="x"), choice=0, logprobs=None,
                                   extra_stop=("y", "x", "z"))  # fmt: skip
    assert params.stop == ("x", "y", "z")
    assert build_sampling_params(_native(), choice=0, logprobs=None).stop == ()


@pytest.mark.parametrize(
    "fields, param",
    [
        (_openai(seed=2**63 - 2), "seed"),
        (_native(sampling_seed=2**63 - 2), "sampling_params.sampling_seed"),
    ],
)
def test_a_seed_past_int64_for_a_later_choice_is_a_400_naming_the_dialects_field(
    fields: SamplingFields, param: str
) -> None:
    assert build_sampling_params(fields, choice=1, logprobs=None).seed == 2**63 - 1
    with pytest.raises(APIError) as caught:
        build_sampling_params(fields, choice=2, logprobs=None)
    assert caught.value.param == param


def test_params_refused_by_sampling_params_name_the_dialects_field() -> None:
    """SGLang's route names `sampling_params`; OpenAI's lets the message name its field."""
    with pytest.raises(APIError) as caught:
        build_sampling_params(_native(), choice=0, logprobs=21)
    assert caught.value.param == "sampling_params"
    with pytest.raises(RequestError, match="logprobs"):
        build_sampling_params(_openai(), choice=0, logprobs=21)
    build_sampling_params(_openai(), choice=0, logprobs=20)  # the control: in range, built
