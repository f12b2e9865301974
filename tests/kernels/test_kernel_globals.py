"""Triton kernels may read a module global only if it is a compile-time constant
(`tl.constexpr(...)`), another @triton.jit function, a Triton builtin or a module (tl, triton).
Triton's compiler refuses any other global, while the interpreter, which is how CI runs the
kernels, accepts it silently: a kernel that reads a plain int passes every CPU test and fails
to compile on the GPU. Checked on the source of every @triton.jit function in
lockstep/ops/triton/ (CPU only)."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import re

import pytest

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from lockstep.ops.triton import launch  # noqa: E402

KERNEL_DIR = pathlib.Path(launch.__file__).parent
# Python builtins the kernels call; the compiler handles these names itself.
JIT_BUILTINS = {"range", "float", "int", "min", "max", "len", "isinstance", "bool"}


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) == "triton.jit"


def _globals_read(fn: ast.FunctionDef) -> set[str]:
    """Names the function reads that it neither takes nor assigns."""
    args = fn.args
    local = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and not isinstance(
        n.ctx, ast.Load)}  # fmt: skip
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and n.id not in local}  # fmt: skip


def _allowed(value: object) -> bool:
    """A jit function (JITFunction; InterpretedFunction under the interpreter), a Triton
    builtin (tl functions, `triton.language.extra` ones such as gdc_wait), a tl.constexpr, or a
    module."""
    kind = type(value).__name__
    return (
        kind in ("JITFunction", "InterpretedFunction")
        or getattr(value, "__triton_builtin__", False)
        or isinstance(value, tl.constexpr)
        or inspect.ismodule(value)
    )


def violations(tree: ast.Module, namespace: dict) -> list[str]:
    """`function: name` for every global a @triton.jit function reads that the compiler
    would refuse (`namespace`: the module's globals)."""
    out = []
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and any(_is_jit(d) for d in fn.decorator_list):
            for name in sorted(_globals_read(fn)):
                if name in namespace:
                    ok = _allowed(namespace[name])
                else:
                    ok = name in JIT_BUILTINS or not hasattr(builtins, name)
                if not ok:
                    out.append(f"{fn.name}: {name}")
    return out


def test_kernels_read_only_compile_time_globals() -> None:
    checked = decorated = 0
    for path in sorted(KERNEL_DIR.glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"lockstep.ops.triton.{path.stem}")
        source = path.read_text()
        tree = ast.parse(source)
        assert not violations(tree, vars(module)), (path.name, violations(tree, vars(module)))
        checked += sum(isinstance(f, ast.FunctionDef) and any(_is_jit(d) for d in
                       f.decorator_list) for f in tree.body)  # fmt: skip
        decorated += len(re.findall(r"^@triton\.jit\b", source, re.MULTILINE))
    # Not blind: every decorated function was read (the package has more than 20).
    assert checked == decorated >= 20, (checked, decorated)


def test_the_check_sees_a_plain_global() -> None:
    """Negative control: the bug the rule exists for (a plain int read inside a kernel) is
    caught; a tl.constexpr global, a jit helper and tl are not."""
    source = (
        "LIMIT = 4\nSTEP = tl.constexpr(2)\n"
        "@triton.jit\ndef helper(x):\n    return x\n"
        "@triton.jit\ndef kernel(x, N: tl.constexpr):\n"
        "    y = helper(x) + STEP\n    for i in range(N):\n        y = y + LIMIT + i\n"
        "    return tl.maximum(y, 0.0)\n"
    )
    namespace: dict = {"tl": tl, "LIMIT": 4, "STEP": tl.constexpr(2)}
    tree = ast.parse(source)
    namespace["helper"] = type("JITFunction", (), {})()
    assert violations(tree, namespace) == ["kernel: LIMIT"]
