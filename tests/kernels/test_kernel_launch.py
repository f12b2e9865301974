"""The programmatic-dependent-launch rule (lockstep/ops/triton/launch.py), checked on the source:
every kernel this package launches takes a `PDL` constexpr, calls `wait_for_inputs(PDL)` before
anything else, and is launched with `pdl_launch(...)`'s arguments. A kernel that started early
without the wait could read its inputs before the previous kernel wrote them, so this is the
test that stands between PDL and a silent race. Runs on CPU (source only)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

pytest.importorskip("triton")

from lockstep.ops.triton import launch  # noqa: E402

KERNEL_DIR = pathlib.Path(launch.__file__).parent


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in KERNEL_DIR.glob("*.py") if p.name not in ("__init__.py", "launch.py"))


def _launches(tree: ast.Module) -> list[tuple[str, ast.Call]]:
    """(kernel name, call) for every `kernel[grid](...)` in a module."""
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
        ):
            out.append((node.func.value.id, node))
    return out


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def _passes_pdl_launch(call: ast.Call, tree: ast.Module) -> bool:
    """The launch forwards `**pdl_launch(...)`, or `**name` where the module builds `name` from
    pdl_launch (directly or through a helper whose body calls it)."""
    builders = {"pdl_launch"} | {
        n.name for n in tree.body
        if isinstance(n, ast.FunctionDef) and "pdl_launch(" in ast.unparse(n)
    }  # fmt: skip
    built = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and any(f"{b}(" in ast.unparse(n.value) for b in builders)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    for kw in call.keywords:
        if kw.arg is None:  # **something
            v = kw.value
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in builders:
                return True
            if isinstance(v, ast.Name) and v.id in built:
                return True
    return False


def test_every_launched_kernel_waits_for_its_inputs_first() -> None:
    checked = []
    for path in _modules():
        source = path.read_text()
        tree = ast.parse(source)
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name, call in _launches(tree):
            kernel = functions[name]
            args = [a.arg for a in kernel.args.args]
            assert "PDL" in args, f"{path.name}:{name} takes no PDL constexpr"
            first = ast.unparse(_first_statement(kernel))
            assert first == "wait_for_inputs(PDL)", f"{path.name}:{name} starts with {first!r}"
            assert _passes_pdl_launch(call, tree), f"{path.name}:{name} launched without pdl_launch"
            checked.append(f"{path.name}:{name}")
    # Every kernel module launches something; an empty list would make this test blind.
    assert len(checked) >= 13, checked


def test_the_check_sees_a_kernel_that_skips_the_wait() -> None:
    """Negative control: a kernel whose first statement is not the wait is caught."""
    bad = ast.parse(
        "def k(x, PDL):\n    y = x\n    wait_for_inputs(PDL)\n"
        "def run():\n    k[(1,)](x, **pdl_launch(d))\n"
    )
    functions = {n.name: n for n in bad.body if isinstance(n, ast.FunctionDef)}
    ((name, call),) = _launches(bad)
    assert ast.unparse(_first_statement(functions[name])) != "wait_for_inputs(PDL)"
    assert _passes_pdl_launch(call, bad)
    unlaunched = ast.parse("def run():\n    k[(1,)](x, num_warps=4)\n")
    ((_, call),) = _launches(unlaunched)
    assert not _passes_pdl_launch(call, unlaunched)


def test_pdl_is_off_without_cuda_and_under_the_interpreter() -> None:
    assert launch.pdl_launch(torch.device("cpu"), 1) == {"PDL": False}


def test_pdl_only_for_calls_of_few_rows(monkeypatch) -> None:
    """Where PDL is available, calls of up to PDL_MAX_ROWS rows use it and bigger ones do
    not (their kernels are long: an early launch only holds SM resources)."""
    monkeypatch.setattr(launch, "pdl_enabled", lambda device: True)
    cuda = torch.device("cuda")
    assert launch.pdl_launch(cuda, 1) == {"PDL": True, "launch_pdl": True}
    assert launch.pdl_launch(cuda, launch.PDL_MAX_ROWS)["PDL"] is True
    assert launch.pdl_launch(cuda, launch.PDL_MAX_ROWS + 1) == {"PDL": False}
    assert launch.pdl_launch(cuda, 8192) == {"PDL": False}
