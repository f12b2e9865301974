"""Gated DeltaNet on the GPU: the gated delta rule in chunks at absolute positions, and the
element-wise gates and norms of a linear-attention layer (lockstep.models.linear_attention).

`gated_delta_rule` runs one program per (value head, tile of BV value columns) over one
sequence's rows in order. It keeps the boundary state tile S [Dk, BV], the open chunk's keys
[C, Dk], cumulative log decays [C] and corrected values [C, BV] in registers, and computes
each row r of chunk c with the formula of the CPU kernel (`gdn_rule`, csrc/lockstep_cpu.cpp):

    u_r   = beta_r (v_r - e^gamma_r S^T k_r) - sum_{j<r} beta_r (k_r.k_j) e^(gamma_r-gamma_j) u_j
    out_r = e^gamma_r S^T q_r + sum_{j<=r} (q_r.k_j) e^(gamma_r-gamma_j) u_j
    S'    = e^gamma_(C-1) S + sum_j e^(gamma_(C-1)-gamma_j) k_j u_j^T    (after row C-1,
            one outer product after another, j ascending)

Sums run over the whole chunk with the rows after r masked to zero, so every row, whatever
the step it is computed in, goes through the same reductions of the same shapes: a one-row
decode step and a prefill give the same bits. The bits differ from the CPU's (the contract is
per device type). No program reads what another writes in the same launch: each reads the
open keys and decays from a copy taken before the launch (tile 0 of a head writes them back),
and each tile owns its value columns of S and of the open rows. A call's row count and start
are not specialized on and multiply-add contraction is off, so a one-row call runs the code a
long one does.
The rows run one after another (O(n C Dk) per program): not yet fast; a chunked
tensor-core form with the same per-row arithmetic is the next step (docs/gpu.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs

# Value columns per program (a power of two; Dv is padded to it).
BLOCK_V = 32


# A call's row count and first position are runtime values: Triton would otherwise compile a
# one-row call (n == 1) or a 16-aligned start as a kernel of its own, whose code the compiler
# may contract differently (docs/gpu.md, "gated_delta.py").
@triton.jit(do_not_specialize=["n", "start", "first_boundary"])
def _gdn_rule_kernel(
    q, k, v, g, beta, state, open_k_in, open_gamma_in, open_k, open_gamma, open_u, out, bounds,
    n, start, first_boundary, HK, HV, DK, DV,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    h = tl.program_id(0)
    tile = tl.program_id(1)
    kh = h // (HV // HK)
    dk = tl.arange(0, BK)
    dv = tile * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    mk, mv = dk < DK, dv < DV
    s_ptr = state + h * DK * DV + dk[:, None] * DV + dv[None, :]
    s = tl.load(s_ptr, mask=mk[:, None] & mv[None, :], other=0.0)
    kk = tl.load(open_k_in + (rows[:, None] * HK + kh) * DK + dk[None, :], mask=mk[None, :],
                 other=0.0)  # fmt: skip
    gammas = tl.load(open_gamma_in + rows * HV + h)
    uu = tl.load(open_u + (rows[:, None] * HV + h) * DV + dv[None, :], mask=mv[None, :], other=0.0)
    for i in range(0, n):
        p = start + i
        r = p % C
        qi = tl.load(q + (i * HK + kh) * DK + dk, mask=mk, other=0.0)
        ki = tl.load(k + (i * HK + kh) * DK + dk, mask=mk, other=0.0)
        vi = tl.load(v + (i * HV + h) * DV + dv, mask=mv, other=0.0)
        bi = tl.load(beta + i * HV + h)
        prev = tl.sum(tl.where(rows == r - 1, gammas, 0.0), axis=0)
        gam = tl.where(r == 0, 0.0, prev) + tl.load(g + i * HV + h)
        gammas = tl.where(rows == r, gam, gammas)
        kk = tl.where(rows[:, None] == r, ki[None, :], kk)
        e = tl.exp(gam)
        ks = tl.sum(s * ki[:, None], axis=0)
        qs = tl.sum(s * qi[:, None], axis=0)
        decay = tl.exp(tl.where(rows <= r, gam - gammas, float("-inf")))
        a = tl.where(rows < r, (bi * tl.sum(kk * ki[None, :], axis=1)) * decay, 0.0)
        u = bi * (vi - e * ks) - tl.sum(a[:, None] * uu, axis=0)
        uu = tl.where(rows[:, None] == r, u[None, :], uu)
        c = tl.sum(kk * qi[None, :], axis=1) * decay
        o = e * qs + tl.sum(c[:, None] * uu, axis=0)
        tl.store(out + (i * HV + h) * DV + dv, o, mask=mv)
        if r == C - 1:
            # S' = e S + sum_j (w_j k_j) u_j^T, one outer product at a time in ascending j,
            # row j taken out of the chunk tiles by a masked sum (exact: one value plus
            # zeros). Not a tl.dot: with one, on an H200, the boundary state (though no row's
            # output) depended on how many open rows the call had loaded from memory.
            kw = kk * tl.exp(gam - gammas)[:, None]
            s = s * e
            for j in range(0, C):
                kj = tl.sum(tl.where(rows[:, None] == j, kw, 0.0), axis=0)
                uj = tl.sum(tl.where(rows[:, None] == j, uu, 0.0), axis=0)
                s = s + kj[:, None] * uj[None, :]
            b = (p + 1 - first_boundary) // C
            tl.store(bounds + b * HV * DK * DV + h * DK * DV + dk[:, None] * DV + dv[None, :],
                     s, mask=mk[:, None] & mv[None, :])  # fmt: skip
    tl.store(s_ptr, s, mask=mk[:, None] & mv[None, :])
    tl.store(open_u + (rows[:, None] * HV + h) * DV + dv[None, :], uu, mask=mv[None, :])
    if tile == 0:
        tl.store(open_gamma + rows * HV + h, gammas)
        if h % (HV // HK) == 0:
            tl.store(open_k + (rows[:, None] * HK + kh) * DK + dk[None, :], kk, mask=mk[None, :])


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    open_k: torch.Tensor,
    open_gamma: torch.Tensor,
    open_u: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """`Ops.gated_delta_rule` (lockstep.ops.base): float32 contiguous tensors, the state and
    open rows updated in place; returns out [n, Hv, Dv] and the state at every multiple of C
    in (start, start + n]."""
    tensors = (q, k, v, g, beta, state, open_k, open_gamma, open_u)
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise ValueError("gated_delta_rule wants contiguous float32 tensors")
    n, hk, dk = q.shape
    hv, dv, chunk = v.shape[1], v.shape[2], open_k.shape[0]
    if hv % hk or state.shape != (hv, dk, dv) or chunk & (chunk - 1):
        raise ValueError(f"gated_delta_rule: q [n, Hk, Dk] {tuple(q.shape)}, v {tuple(v.shape)}, "
                         f"state {tuple(state.shape)}, chunk {chunk} (a power of two)")  # fmt: skip
    first = (start // chunk + 1) * chunk
    count = (start + n - first) // chunk + 1 if start + n >= first else 0
    out = torch.empty((n, hv, dv), dtype=torch.float32, device=q.device)
    bounds = torch.empty((count, hv, dk, dv), dtype=torch.float32, device=q.device)
    if n:
        grid = (hv, triton.cdiv(dv, BLOCK_V))
        # Keys and decays are shared by the programs of a head (and of a key head's group):
        # every program reads this call's copies, tile 0 writes the new rows.
        _gdn_rule_kernel[grid](
            q, k, v, g, beta, state, open_k.clone(), open_gamma.clone(), open_k, open_gamma,
            open_u, out, bounds,
            n, start, first, hk, hv, dk, dv,
            C=chunk, BK=triton.next_power_of_2(dk), BV=BLOCK_V, num_warps=4,
            **_opts(q.device),
        )  # fmt: skip
    return out, [(first + i * chunk, bounds[i]) for i in range(count)]


def _opts(device: torch.device) -> dict:
    """Launch options of every kernel here: multiply-add contraction off, so each formula
    rounds as written whatever code the compiler makes of a call's shape (the interpreter
    takes no compiler options and never contracts); PDL on wherever the device has it, for
    calls of every row count (elsewhere only up to `PDL_MAX_ROWS`), so that a one-row decode
    step and a long prefill run one compiled kernel, not two variants."""
    opts = pdl_launch(device, 0)
    if not interpreting():
        opts["enable_fp_fusion"] = False
    return opts


@triton.jit
def _gates_kernel(a, b, a_log, dt_bias, g, beta, total, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    head = offs % H
    x = tl.load(a + offs, mask=mask, other=0.0) + tl.load(dt_bias + head, mask=mask, other=0.0)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(g + offs, -(tl.exp(tl.load(a_log + head, mask=mask, other=0.0)) * softplus), mask=mask)
    bv = tl.load(b + offs, mask=mask, other=0.0)
    tl.store(beta + offs, 1.0 / (1.0 + tl.exp(-bv)), mask=mask)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), per element of [T, H]."""
    a, b = a.float().contiguous(), b.float().contiguous()
    g, beta = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        _gates_kernel[(triton.cdiv(a.numel(), 1024),)](
            a, b, a_log.float().contiguous(), dt_bias.float().contiguous(), g, beta, a.numel(),
            a.shape[1], BLOCK=1024, **_opts(a.device),
        )  # fmt: skip
    return g, beta


@triton.jit
def _l2_kernel(x, y, D, eps, scale, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    h = tl.load(x + row * D + offs, mask=mask, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) + eps)
    tl.store(y + row * D + offs, (h * inv) * scale, mask=mask)


def l2_normalize(x: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    """x [R, D] -> x / sqrt(sum(x^2) + eps) * scale, one row per program."""
    x = x.float().contiguous()
    y = torch.empty_like(x)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _l2_kernel[(x.shape[0],)](
            x, y, x.shape[1], float(eps), float(scale), BLOCK=block,
            **_opts(x.device),
        )  # fmt: skip
    return y


@triton.jit
def _gate_kernel(x, gate, y, total, SIGMOID: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    xv = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    gv = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
    act = 1.0 / (1.0 + tl.exp(-gv)) if SIGMOID else gv / (1.0 + tl.exp(-gv))
    tl.store(y + offs, (xv * act).to(y.dtype.element_ty), mask=mask)


def gate_activation(x: torch.Tensor, gate: torch.Tensor, kind: str) -> torch.Tensor:
    """x * sigmoid(gate) ("sigmoid") or x * silu(gate) ("silu"), per element, in x's dtype."""
    if kind not in ("sigmoid", "silu") or x.shape != gate.shape:
        raise ValueError(f"gate_activation: kind {kind!r} (sigmoid or silu), shapes "
                         f"{tuple(x.shape)} and {tuple(gate.shape)} must agree")  # fmt: skip
    x, gate = x.contiguous(), gate.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _gate_kernel[(triton.cdiv(x.numel(), 1024),)](
            x, gate, y, x.numel(), SIGMOID=kind == "sigmoid", BLOCK=1024,
            **_opts(x.device),
        )  # fmt: skip
    return y
