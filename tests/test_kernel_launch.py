"""The programmatic-dependent-launch rule (lockstep/ops/triton/launch.py), checked on the source:
every kernel this package launches takes a `PDL` constexpr, calls `wait_for_inputs(PDL)` before
touching memory, and is launched with `pdl_launch(...)`'s arguments. Before the wait a kernel
may only compute from program ids and scalars and issue `l2_prefetch` hints (of weights, which
no kernel writes), directly or through helpers of its module, checked transitively. A kernel
that started early without the wait could read its inputs before the previous kernel wrote
them, so this is the test that stands between PDL and a silent race. Runs on CPU (source
only)."""

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


# Calls that touch no memory (or only hint L2), allowed before the wait: these `tl.` functions,
# the `.to` cast, and `l2_prefetch`. Module helpers are checked through their bodies.
TL_NO_MEMORY = {"program_id", "num_programs", "arange", "where", "minimum", "maximum", "cdiv",
                "zeros", "full"}  # fmt: skip


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body


def _call_allowed(call: ast.Call, functions: dict, seen: frozenset) -> bool:
    f = call.func
    if isinstance(f, ast.Name):
        if f.id in functions:  # a module helper, even one named like an allowed function
            return f.id not in seen and _touches_no_memory(
                _body(functions[f.id]), functions, seen | {f.id}
            )
        return f.id == "l2_prefetch"
    if isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Name) and f.value.id == "tl":
            return f.attr in TL_NO_MEMORY
        return f.attr == "to"  # a dtype cast of a value
    return False


def _touches_no_memory(
    stmts: list[ast.stmt], functions: dict, seen: frozenset = frozenset()
) -> bool:
    """Every call in these statements is allowed (above), directly or through helpers."""
    return all(
        _call_allowed(n, functions, seen)
        for stmt in stmts
        for n in ast.walk(stmt)
        if isinstance(n, ast.Call)
    )


def _waits_first(kernel: ast.FunctionDef, functions: dict) -> bool:
    body = _body(kernel)
    waits = [i for i, st in enumerate(body) if ast.unparse(st) == "wait_for_inputs(PDL)"]
    return bool(waits) and _touches_no_memory(body[: waits[0]], functions)


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
            assert _waits_first(kernel, functions), f"{path.name}:{name} touches memory first"
            assert _passes_pdl_launch(call, tree), f"{path.name}:{name} launched without pdl_launch"
            checked.append(f"{path.name}:{name}")
    # Every kernel module launches something; an empty list would make this test blind.
    assert len(checked) >= 8, checked


def test_the_check_sees_a_kernel_that_skips_the_wait() -> None:
    """Negative controls: a load before the wait, directly or inside a helper, and a kernel
    without the wait are caught; prefetch hints and arithmetic are not."""

    def verdict(src: str) -> bool:
        tree = ast.parse(src)
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        return _waits_first(functions["k"], functions)

    assert not verdict("def k(x, PDL):\n    y = tl.load(x)\n    wait_for_inputs(PDL)\n")
    assert not verdict(
        "def h(x):\n    return x.load([0, 0])\n"
        "def k(x, PDL):\n    if P:\n        h(x)\n    wait_for_inputs(PDL)\n"
    )
    assert not verdict("def k(x, PDL):\n    y = x + 1\n")
    assert not verdict(
        "def where(x):\n    return tl.load(x)\n"
        "def k(x, PDL):\n    where(x)\n    wait_for_inputs(PDL)\n"
    )
    assert not verdict("def k(x, PDL):\n    x.load([0])\n    wait_for_inputs(PDL)\n")
    assert verdict(
        "def h(w, i):\n    l2_prefetch(w + tl.arange(0, 4) * i, 16)\n"
        "def k(w, PDL):\n    if P:\n        h(w, tl.program_id(0))\n"
        "    wait_for_inputs(PDL)\n    tl.load(w)\n"
    )
    bad = ast.parse("def k(x, PDL):\n    wait_for_inputs(PDL)\n"
                    "def run():\n    k[(1,)](x, **pdl_launch(d))\n")  # fmt: skip
    ((_, call),) = _launches(bad)
    assert _passes_pdl_launch(call, bad)
    unlaunched = ast.parse("def run():\n    k[(1,)](x, num_warps=4)\n")
    ((_, call),) = _launches(unlaunched)
    assert not _passes_pdl_launch(call, unlaunched)


def test_pdl_is_off_without_cuda_and_under_the_interpreter() -> None:
    assert launch.pdl_launch(torch.device("cpu")) == {"PDL": False}
