"""A minimal GRPO-style loop: the engine samples groups, the training module
recomputes the sampled tokens' logprobs (the sampler's bits, so the importance ratio is
exactly 1 and the k3 KL between the rollout and training policies exactly 0), an optimizer
step follows, and the new weights go back to the engine in-process.

    python -m lockstep.training.grpo                      # the embedded default model
    python -m lockstep.training.grpo --model random:tiny --steps 5
    python -m lockstep.training.grpo --model random:qwen3-8b,layers=4 --device cuda \
        --dtype bfloat16

One line per step, then one JSON document on the last line (every step's figures). The
reward is a toy (the share of the letter "e" in the completion's text): the point is the
plumbing and the zero mismatch, not what is learnt.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from lockstep import LLM, SamplingParams
from lockstep.training.model import LockstepForCausalLM

PROMPTS = ("The weather today is", "My favourite food is")


@dataclass
class StepReport:
    """One step: the group-mean reward, the surrogate loss, the largest |k3| and the range of
    the importance ratio over every sampled token, and the sampled token count. On-policy the
    surrogate's value is about 0 (each group's advantages add up to 0); its gradient is not."""

    step: int
    reward: float
    loss: float
    k3_max: float
    ratio_min: float
    ratio_max: float
    tokens: int


def e_share(text: str) -> float:
    """The toy reward: the share of the letter "e" among the text's characters."""
    return text.count("e") / max(len(text), 1)


def run(
    model: str | None = None,
    steps: int = 5,
    group_size: int = 4,
    prompts: tuple[str, ...] = PROMPTS,
    max_tokens: int = 16,
    lr: float = 1e-4,
    seed: int = 0,
    reward: Callable[[str], float] = e_share,
    trainer_mode: str = "deterministic",
    on_step: Callable[[StepReport], None] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    kv_tokens: int | None = None,
) -> tuple[list[StepReport], LockstepForCausalLM, LLM]:
    """`steps` GRPO steps with the engine and the trainer on `device` in `dtype` ("float32" or
    "bfloat16"), each picking its backend as the engine does; `kv_tokens`: the engine's KV
    pool (None: the engine's default, which on CUDA takes most of the free memory; give a
    size there to leave the trainer room); returns the reports, the trained module and
    the engine (which serves the trained weights). Each sampled token's rollout logprob is
    the sampler's, its training logprob the module's; k3 = exp(d) - d - 1 with d = rollout -
    training logprob, ratio = exp(-d). `trainer_mode` "reference" recomputes on the stock-torch
    backend (a control: then the two policies differ in their last bits; "fast" is its old
    name)."""
    llm = LLM(model, device=device, dtype=dtype, kv_tokens=kv_tokens)
    trainer = LockstepForCausalLM.from_pretrained(
        model, device=device, dtype=getattr(torch, dtype), mode=trainer_mode
    )
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
    prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
    reports = []
    for step in range(steps):
        rollouts = [ids for ids in prompt_ids for _ in range(group_size)]
        params = [
            SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0,
                           seed=seed * 1_000_003 + step * 1_009 + j)
            for j in range(len(rollouts))
        ]  # fmt: skip
        outs = llm.generate(rollouts, params, use_tqdm=False)
        rewards = torch.tensor([reward(o.text) for o in outs], dtype=torch.float64)
        # Group-normalized advantages (GRPO): each completion against its prompt's group.
        groups = rewards.view(len(prompt_ids), group_size)
        std = groups.std(dim=1, keepdim=True).clamp(min=1e-6)
        advantages = ((groups - groups.mean(dim=1, keepdim=True)) / std).reshape(-1)
        out = trainer([p + o.token_ids for p, o in zip(rollouts, outs, strict=True)])
        surrogate, tokens, k3_max, ratio_lo, ratio_hi = [], 0, 0.0, math.inf, -math.inf
        per_rollout = zip(rollouts, outs, out.per_sequence(), advantages.tolist(), strict=True)
        for p, o, lps, advantage in per_rollout:
            training = lps[len(p) - 1 :]  # the completion's tokens
            rollout = torch.tensor(o.logprobs, dtype=torch.float32, device=training.device)
            d = (rollout - training.detach()).double()
            k3 = d.exp() - d - 1.0
            ratio = (training - rollout).exp()  # 1 exactly when the bits agree
            surrogate.append(-(ratio * advantage).sum())
            tokens += len(o.token_ids)
            k3_max = max(k3_max, k3.abs().max().item())
            ratio_lo = min(ratio_lo, ratio.min().item())
            ratio_hi = max(ratio_hi, ratio.max().item())
        loss = torch.stack(surrogate).sum() / tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        llm.update_weights(trainer.state_dict(), version=f"step-{step + 1}")
        report = StepReport(step + 1, rewards.mean().item(), loss.item(), k3_max, ratio_lo,
                            ratio_hi, tokens)  # fmt: skip
        reports.append(report)
        if on_step is not None:
            on_step(report)
    return reports, trainer, llm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="what --model accepts (default: embedded)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=16384,
        help="the engine's KV pool; the rest of the device is the trainer's",
    )
    args = parser.parse_args(argv)
    print("step  reward   loss       k3_max  ratio_min  ratio_max  tokens")

    def show(r: StepReport) -> None:
        print(f"{r.step:4d}  {r.reward:.4f}  {r.loss:+.6f}  {r.k3_max:.1e}  {r.ratio_min:.7f}"
              f"  {r.ratio_max:.7f}  {r.tokens}")  # fmt: skip

    reports, _, _ = run(args.model, args.steps, args.group_size, PROMPTS, args.max_tokens,
                        args.lr, args.seed, on_step=show, device=args.device,
                        dtype=args.dtype, kv_tokens=args.kv_tokens)  # fmt: skip
    print(json.dumps({"steps": [asdict(r) for r in reports]}))


if __name__ == "__main__":
    main()
