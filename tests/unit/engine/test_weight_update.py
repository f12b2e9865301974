"""Weight updates without a restart (`LLM.update_weights`, `Engine.update_weights_from_disk`):
new weights give exactly what a fresh engine on them gives, the old ones come back bit for
bit, and a bad set of tensors is refused with the old weights still serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.errors import ModelLoadError, RequestError  # noqa: E402
from tests.support.tiny_hf import save_tiny  # noqa: E402

PROMPTS = [[5, 17, 33, 64, 90], [200, 3, 41, 7, 7, 7, 120, 250]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def _llm(folder: Path) -> LLM:
    return LLM(str(folder), device="cpu", kv_tokens=1024, max_batch_tokens=64, chunk_size=16)


def _run(llm: LLM) -> list[tuple[list[int], list[float], list]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]


# qwen2: tied embeddings; qwen3_moe: a state dict with transformers' fused expert tensors.
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "qwen3_moe"])
def test_update_from_state_dict_and_back_from_disk(tmp_path: Path, family: str) -> None:
    save_tiny(family, tmp_path / "a", seed=1)
    model_b = save_tiny(family, tmp_path / "b", seed=2)
    llm = _llm(tmp_path / "a")
    on_a = _run(llm)
    on_b_fresh = _run(_llm(tmp_path / "b"))
    assert on_b_fresh != on_a  # the control: the two weight sets are told apart
    # A trainer's state dict (its names, float32, lm_head listed even when tied).
    state = model_b.state_dict()
    if family == "qwen3_moe":
        assert "model.layers.0.mlp.experts.gate_up_proj" in state
    llm.update_weights(state, version="step-1")
    assert _run(llm) == on_b_fresh
    assert llm.engine.weight_version == "step-1"
    llm.update_weights(str(tmp_path / "a"))
    assert _run(llm) == on_a
    llm.engine.check_integrity()


def test_bad_tensors_are_refused_and_the_old_weights_serve_on(tmp_path: Path) -> None:
    model_a = save_tiny("qwen3", tmp_path / "a", seed=1)
    llm = _llm(tmp_path / "a")
    on_a = _run(llm)
    good = {k: v.clone() for k, v in model_a.state_dict().items()}
    name = "model.layers.1.mlp.down_proj.weight"
    missing = {k: v for k, v in good.items() if k != name}
    wrong_shape = {**good, name: good[name][:, :-1]}
    unexpected = {**good, "model.layers.9.mlp.down_proj.weight": good[name]}
    # Every other tensor changed, so a partial copy before the refusal would show.
    for bad, needle in ((missing, "missing"), (wrong_shape, "shape"), (unexpected, "unexpected")):
        bad = {k: (v + 1.0 if k != name else v) for k, v in bad.items()}
        with pytest.raises(ModelLoadError, match=needle):
            llm.update_weights(bad)
        assert _run(llm) == on_a
    save_tiny("llama", tmp_path / "other", seed=3)
    with pytest.raises(ModelLoadError, match="architecture"):
        llm.update_weights(str(tmp_path / "other"))
    assert _run(llm) == on_a


def test_update_is_refused_while_requests_run(tmp_path: Path) -> None:
    """A running request holds KV of the old weights: refused. A waiting one (retracted, as
    `/pause_generation` does, or not admitted yet) computes all with the new weights."""
    model_a = save_tiny("qwen3", tmp_path / "a", seed=1)
    llm = _llm(tmp_path / "a")
    llm.engine.add_request("running", PROMPTS[0], GREEDY)
    llm.engine.step()
    with pytest.raises(RequestError, match="running"):
        llm.update_weights(model_a.state_dict())
    assert llm.engine.retract_running() == 1
    llm.engine.add_request("waiting", PROMPTS[1], GREEDY)
    llm.update_weights({k: v.to(torch.bfloat16) for k, v in model_a.state_dict().items()})
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.check_integrity()


def test_moe_fused_experts_of_the_wrong_shape_are_refused(tmp_path: Path) -> None:
    model = save_tiny("qwen3_moe", tmp_path / "a", seed=1)
    llm = _llm(tmp_path / "a")
    on_a = _run(llm)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    state = {k: v + 1.0 for k, v in model.state_dict().items()}
    state[name] = state[name][:, :-2]  # [E, 2I - 2, H]: each gate and up one row short
    with pytest.raises(ModelLoadError, match=r"experts\.0\.gate_proj\.weight' has shape"):
        llm.update_weights(state)
    assert _run(llm) == on_a
