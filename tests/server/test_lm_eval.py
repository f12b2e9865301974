"""lm-evaluation-harness as a real client: its `local-completions` and `local-chat-completions`
models against a real `lockstep serve`, and its `hf` backend (transformers, float32) on the same
tiny Qwen3 folder, over the two tasks of tests/lm_eval_tasks (a multiple-choice loglikelihood
task and a greedy `generate_until` task, local jsonl data).

What must hold, per sample: the same choice logprobs within 1e-4 and the same accuracy as the
hf backend, the same generations character for character (plain and through the chat
template); and bit-identical results whatever lm-eval's `batch_size` and concurrency. The
controls: the hf backend in bfloat16 is caught by the same 1e-4 comparison, and the bitwise
comparison catches a perturbed logprob. lm-eval finds the server's tokenizer through
`/tokenizer_info` and `/tokenize` (its `remote` tokenizer), as it does for vLLM.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server import ServerProcess

from tests.support.tiny_hf import save_tiny

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # about 40 s of CPU: a server start, seven lm-eval runs

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "lm_eval_tasks"
LOGPROB_TOLERANCE = 1e-4  # Lockstep's CPU kernels against transformers' float32 forward


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny("qwen3", path)
    return path


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(folder), "--device", "cpu", "--kv-tokens", "4096"])
    yield proc.start()
    proc.stop()


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No hub: the tasks' data are local files; their cache goes to a temporary folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        patch.chdir(REPO)  # the task YAMLs name their data relative to the repository
        logging.getLogger("lm-eval").setLevel(logging.WARNING)
        yield


def _evaluate(model: str, model_args: dict[str, Any], tasks: list[str], **kwargs: Any) -> dict:
    """lm-eval's per-sample results: {task: {doc_id: sample}}."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )
    assert results is not None
    return {task: {s["doc_id"]: s for s in samples} for task, samples in results["samples"].items()}


def _hf(folder: Path, tasks: list[str], dtype: str = "float32", **kwargs: Any) -> dict:
    args = {"pretrained": str(folder), "dtype": dtype, "device": "cpu"}
    return _evaluate("hf", args, tasks, batch_size=1, **kwargs)


def _served(server: ServerProcess, route: str, concurrency: int) -> dict[str, Any]:
    return {
        "model": server.model,
        "base_url": f"{server.base_url}/v1/{route}",
        "num_concurrent": concurrency,
        "max_length": 512,
    }


def _choice_logprobs(sample: dict) -> list[float]:
    return [float(resp[0][0]) for resp in sample["resps"]]


def logprob_mismatches(reference: dict, other: dict, tolerance: float) -> list[str]:
    """Multiple-choice samples whose choice logprobs differ by more than `tolerance`, or whose
    accuracy differs without a near-tie (the two best choices within `tolerance`)."""
    problems = []
    for doc_id, ref in reference.items():
        ours = other[doc_id]
        a, b = _choice_logprobs(ref), _choice_logprobs(ours)
        worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
        if not worst <= tolerance:
            problems.append(f"doc {doc_id}: choice logprobs differ by {worst:.3g}")
        if ref["acc"] != ours["acc"]:
            best, second = sorted(a)[-2:][::-1]
            if best - second > tolerance:
                problems.append(f"doc {doc_id}: acc {ref['acc']} != {ours['acc']}")
    return problems


def generation_mismatches(reference: dict, other: dict) -> list[str]:
    return [
        f"doc {doc_id}: {ref['resps'][0][0]!r} != {other[doc_id]['resps'][0][0]!r}"
        for doc_id, ref in reference.items()
        if ref["resps"][0][0] != other[doc_id]["resps"][0][0]
    ]


def bitwise_mismatches(a: dict, b: dict) -> list[str]:
    """Samples whose responses differ in any bit (logprobs compared as float bit patterns)."""
    return [f"doc {doc_id}" for doc_id, s in a.items() if s["resps"] != b[doc_id]["resps"]]


def test_lm_eval_through_lockstep_matches_the_hf_backend(
    folder: Path, server: ServerProcess
) -> None:
    tasks = ["lockstep_mc", "lockstep_gen"]
    hf = _hf(folder, tasks)
    one = _evaluate("local-completions", _served(server, "completions", 1), tasks, batch_size=1)
    four = _evaluate("local-completions", _served(server, "completions", 3), tasks, batch_size=4)

    assert len(hf["lockstep_mc"]) == 12 and len(hf["lockstep_gen"]) == 8
    assert logprob_mismatches(hf["lockstep_mc"], one["lockstep_mc"], LOGPROB_TOLERANCE) == []
    assert generation_mismatches(hf["lockstep_gen"], one["lockstep_gen"]) == []
    generated = [s["resps"][0][0] for s in one["lockstep_gen"].values()]
    assert sum(len(text) for text in generated) > 8 * 4  # the generations are not empty
    for task in tasks:
        assert bitwise_mismatches(one[task], four[task]) == [], task

    # Controls: bfloat16 is caught by the tolerance; a one-ulp change by the bitwise check.
    bf16 = _hf(folder, ["lockstep_mc"], dtype="bfloat16")
    assert logprob_mismatches(hf["lockstep_mc"], bf16["lockstep_mc"], LOGPROB_TOLERANCE)
    nudged = {k: dict(s) for k, s in four["lockstep_mc"].items()}
    [(logprob, greedy)], *others = nudged[0]["resps"]  # per choice: [(logprob, is_greedy)]
    nudged[0]["resps"] = [[(math.nextafter(logprob, 0.0), greedy)], *others]
    assert bitwise_mismatches(one["lockstep_mc"], nudged) == ["doc 0"]


def test_lm_eval_chat_completions_match_the_hf_chat_template(
    folder: Path, server: ServerProcess
) -> None:
    hf = _hf(folder, ["lockstep_gen"], apply_chat_template=True)
    served = [
        _evaluate(
            "local-chat-completions",
            _served(server, "chat/completions", concurrency),
            ["lockstep_gen"],
            apply_chat_template=True,
        )["lockstep_gen"]
        for concurrency in (1, 4)
    ]
    assert generation_mismatches(hf["lockstep_gen"], served[0]) == []
    assert bitwise_mismatches(served[0], served[1]) == []
    # The chat template is in the prompt (the control: the plain prompt generates otherwise).
    plain = _hf(folder, ["lockstep_gen"])["lockstep_gen"]
    assert generation_mismatches(plain, served[0])
