"""Compare Lockstep with Hugging Face transformers (float32, CPU) on the default model.

Both load the same GGUF file. For each of 22 prompts (chat and raw, 1 to ~1,500 tokens):

  * prompt logprobs: Lockstep's teacher-forced logprob of every prompt token (LLM.score)
    against transformers' from one forward pass; reported as max |delta|;
  * greedy-32: Lockstep generates 32 tokens greedily; transformers, fed the same tokens, must
    choose each of them as its own argmax (which, by induction, is exactly its greedy output).
    A disagreement is reported with transformers' margin between its choice and ours, to tell
    a near-tie from a real difference. The generated tokens' logprobs are compared as well.

    python scripts/compare_hf.py [--max-tokens 32]

Prints a table, then one JSON line (the last line) with every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from lockstep.engine.llm import LLM
from lockstep.engine.sampling_params import SamplingParams
from lockstep.models.resolver import default_model_path

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Explain recursion to a ten-year-old."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [
        {"role": "user", "content": "Hi! Can you help me plan a trip?"},
        {"role": "assistant", "content": "Of course. Where would you like to go?"},
        {"role": "user", "content": "Somewhere warm in December, on a small budget."},
    ],
    [
        {"role": "system", "content": "Tu réponds toujours en français."},
        {"role": "user", "content": "Quelle est la plus haute montagne d'Europe ?"},
    ],
    [{"role": "user", "content": "What is 17 * 23? Show your steps."}],
    [{"role": "user", "content": "List the three primary colors."}],
    [{"role": "user", "content": "Translate 'good morning, my friend' into Spanish and German."}],
    [{"role": "user", "content": "What do these mean: 🙂 🚀 ❤️ ?"}],
]


def _numbered_lines(n: int) -> str:
    return "\n".join(
        f"Line {i}: {i} squared is {i * i}, and {i} cubed is {i**3}." for i in range(n)
    )


_HISTORY = (
    "The history of computing spans several centuries, from the mechanical calculators of "
    "Pascal and Leibniz to the analytical engine that Babbage designed but never finished. "
    "Ada Lovelace wrote what many consider the first algorithm meant for such a machine. "
    "Electronic computers replaced relays with vacuum tubes and later transistors, and "
    "integrated circuits eventually put billions of transistors on a single chip. "
)

RAWS = [
    "The",
    "Once upon a time",
    "def fibonacci(n):\n",
    "1, 2, 3, 4, 5,",
    '{"name": "Lockstep", "version": "0.1.0", "features": [',
    "Grüße aus Köln! Привет из Москвы. 東京からこんにちは。 مرحبا من القاهرة.",
    "    indented   text\twith\ttabs\n\n\n   and blank lines   ",
    "| Country | Capital |\n|---|---|\n| France | Paris |\n| Italy |",
    _HISTORY * 2,
    _numbered_lines(40),
    _HISTORY * 4 + _numbered_lines(10),
]
LONG_CHAT = [{"role": "user", "content": "Summarize this text:\n\n" + _HISTORY * 12}]


@dataclass
class Row:
    kind: str
    prompt_tokens: int
    prompt_max_delta: float
    generated: int
    greedy_agree: int  # leading generated tokens that transformers also picks
    generated_max_delta: float
    divergence_margin: float | None  # transformers' logit margin at the first disagreement


def _hf_model():
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    started = time.perf_counter()

    llm = LLM(None, kv_tokens=16384)
    tok = llm.tokenizer
    prompts = [("chat", tok.encode_chat(c)) for c in CHATS]
    prompts += [("raw", tok.encode(r)) for r in RAWS]
    prompts.append(("chat", tok.encode_chat(LONG_CHAT)))
    long_raw = tok.encode(_HISTORY * 10 + _numbered_lines(90))
    prompts.append(("raw", long_raw[:1500]))
    ids_list = [ids for _, ids in prompts]

    scores = llm.score(ids_list, use_tqdm=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = llm.generate(ids_list, greedy, use_tqdm=True)
    hf = _hf_model()

    rows = []
    for (kind, ids), score, out in zip(prompts, scores, outputs, strict=True):
        generated = list(out.token_ids)
        full = ids + generated
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
        targets = torch.tensor(full[1:])
        ref_token = ref[torch.arange(len(full) - 1), targets]
        ours_prompt = torch.tensor(score.logprobs[1:], dtype=torch.float32)
        prompt_delta = (
            (ours_prompt - ref_token[: len(ids) - 1]).abs().max().item() if len(ids) > 1 else 0.0
        )
        gen_ref = ref[len(ids) - 1 : len(full) - 1]
        hf_choice = gen_ref.argmax(dim=-1).tolist()
        agree = next(
            (i for i, (a, b) in enumerate(zip(hf_choice, generated, strict=True)) if a != b),
            len(generated),
        )
        margin = None
        if agree < len(generated):
            margin = (gen_ref[agree, hf_choice[agree]] - gen_ref[agree, generated[agree]]).item()
        ours_gen = torch.tensor(out.logprobs, dtype=torch.float32)
        gen_delta = (ours_gen - ref_token[len(ids) - 1 :]).abs().max().item() if generated else 0.0
        rows.append(Row(kind, len(ids), prompt_delta, len(generated), agree, gen_delta, margin))

    print(
        f"{'#':>3} {'kind':<5} {'tokens':>6} {'max|dlp| prompt':>16} {'max|dlp| gen':>13} {'greedy':>8}"
    )
    for i, r in enumerate(rows):
        greedy_text = f"{r.greedy_agree}/{r.generated}"
        note = (
            ""
            if r.divergence_margin is None
            else f"  (diverges, HF margin {r.divergence_margin:.2e})"
        )
        print(
            f"{i:>3} {r.kind:<5} {r.prompt_tokens:>6} {r.prompt_max_delta:>16.2e} "
            f"{r.generated_max_delta:>13.2e} {greedy_text:>8}{note}"
        )
    worst_prompt = max(r.prompt_max_delta for r in rows)
    worst_gen = max(r.generated_max_delta for r in rows)
    all_agree = sum(r.greedy_agree == r.generated for r in rows)
    print(
        f"worst prompt |delta logprob| {worst_prompt:.2e}; worst generated {worst_gen:.2e}; "
        f"greedy identical on {all_agree}/{len(rows)} prompts"
    )
    summary = {
        "model": llm.engine.model_name,
        "prompts": len(rows),
        "max_prompt_tokens": max(r.prompt_tokens for r in rows),
        "worst_prompt_logprob_delta": worst_prompt,
        "worst_generated_logprob_delta": worst_gen,
        "greedy_identical": all_agree,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [asdict(r) for r in rows],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
