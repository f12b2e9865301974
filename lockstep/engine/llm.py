"""The offline Python API, shaped like vLLM's:

    from lockstep import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model
    out = llm.generate(["What is 2+2?"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text, out[0].logprobs)
    scores = llm.score(["The capital of France is Paris."])

Everything runs through `Engine`; prompts may be strings or lists of token ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.outputs import RequestOutput, StepOutput, TokenLogprob
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import RequestError

Prompt = str | Sequence[int]


@dataclass
class ScoreOutput:
    """Teacher-forced scoring of one text: `logprobs[p]` is log P(token p | tokens < p);
    position 0 has no logprob (None)."""

    prompt: str | None
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TokenLogprob | None]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig.from_options(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (nothing to do at tp=1)."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (together, continuously batched) and return one
        `RequestOutput` per prompt, in order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise RequestError(
                f"got {len(params_list)} sampling params for {len(prompt_list)} prompts: "
                "expected one, or one per prompt"
            )
        for p in params_list:
            if p.n != 1:
                raise RequestError(f"n={p.n} is not supported by LLM.generate: expected n=1 "
                                   "(repeat the prompt with different seeds instead)")  # fmt: skip
        token_lists = [self._encode(p) for p in prompt_list]
        ids = [self._submit("llm", t, p) for t, p in zip(token_lists, params_list, strict=True)]
        results = self._run(ids, use_tqdm)
        return [
            _to_request_output(rid, prompt, tokens, results[rid])
            for rid, prompt, tokens in zip(ids, prompt_list, token_lists, strict=True)
        ]

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> RequestOutput:
        """Apply the model's chat template to `messages` and generate the assistant reply."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate([ids], sampling_params, use_tqdm=use_tqdm)[0]

    def score(
        self, prompts: Prompt | Sequence[Prompt], top_logprobs: int = 0, use_tqdm: bool = True
    ) -> list[ScoreOutput]:
        """Teacher-forced logprob of every position of each prompt. By the engine's contract
        these equal, bit for bit, the logprobs the same tokens got when generated; positions
        whose logprobs the prefix cache holds are served from it, with the same bits."""
        prompt_list = _as_prompt_list(prompts)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_logprobs)
        token_lists = [self._encode(p) for p in prompt_list]
        ids = [self._submit("score", tokens, params) for tokens in token_lists]
        results = self._run(ids, use_tqdm)
        outputs = []
        for rid, prompt, token_ids in zip(ids, prompt_list, token_lists, strict=True):
            entries = results[rid][0].prompt_logprobs or []
            outputs.append(
                ScoreOutput(
                    prompt=prompt if isinstance(prompt, str) else None,
                    token_ids=token_ids,
                    logprobs=[None if e is None else e.logprob for e in entries],
                    top_logprobs=list(entries),
                )
            )
        return outputs

    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str,
        version: str | None = None,
    ) -> None:
        """Serve new weights of the same architecture without reloading the engine: a state
        dict or (name, tensor) pairs in Hugging Face names (e.g. a trainer's
        `model.state_dict()`, any device and dtype), or a checkpoint path. Call it between
        `generate` calls; the prefix cache is flushed. A bad checkpoint raises
        `ModelLoadError` and the old weights keep serving."""
        if isinstance(weights, str):
            self.engine.update_weights_from_disk(weights, version)
        else:
            self.engine.update_weights(weights, version=version)

    def _encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _submit(self, kind: str, token_ids: list[int], params: SamplingParams) -> str:
        request_id = f"{kind}-{self._counter}"
        self._counter += 1
        self.engine.add_request(request_id, token_ids, params)
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, list[StepOutput]]:
        pending = set(request_ids)
        results: dict[str, list[StepOutput]] = {rid: [] for rid in request_ids}
        bar = tqdm(total=len(request_ids), desc="requests", disable=not use_tqdm, leave=False)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in results:
                        results[out.request_id].append(out)
                        if out.finished:
                            pending.discard(out.request_id)
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _to_request_output(
    request_id: str, prompt: Prompt, prompt_ids: list[int], steps: list[StepOutput]
) -> RequestOutput:
    last = steps[-1]
    top = [lp for s in steps for lp in (s.new_logprobs or [])]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt_ids,
        text="".join(s.new_text for s in steps),
        token_ids=[t for s in steps for t in s.new_token_ids],
        logprobs=[lp for s in steps for lp in s.new_token_logprobs],
        top_logprobs=top or None,
        prompt_logprobs=steps[0].prompt_logprobs,
        cached_tokens=last.cached_tokens,
        finish_reason=last.finish_reason or "abort",
        seed=last.seed,
        stop_reason=last.stop_reason,
        routed_experts=last.routed_experts,
    )
