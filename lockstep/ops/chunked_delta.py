"""The chunked gated delta rule in torch: the float32 reference of the tensor-core form
(lockstep/ops/triton/chunked_delta.py) and the CPU engine's path for `gdn_kernel="chunked"`.

Chunks of C rows sit at absolute positions 0, C, 2C, ... Every row's output, and every
boundary state, is computed from one whole chunk tile of C rows (`chunk_tile`):

    chunk tile   rows 0 .. r0-1     | r0 .. r0+m-1   | r0+m .. C-1
                 earlier steps      | this step      | not yet arrived: zero
                 (open buffers:     | (the step's    | (k, v, q, g, beta = 0)
                 k, v, g, beta)     |  rows)         |

with S the state at the chunk's start, gamma the cumulative log decay in the chunk and

    A[i, j] = beta_i (k_i . k_j) e^(gamma_i - gamma_j)       j < i, else 0
    T       = (I + A)^-1                    forward substitution, row i from rows < i
    w       = T (beta e^gamma k)            u = T (beta v)           (the WY / UT form)
    vn      = u - w S                       (the corrected values)
    out_i   = e^gamma_i q_i S + sum_{j<=i} (q_i . k_j) e^(gamma_i - gamma_j) vn_j
    S'      = e^gamma_(C-1) S + sum_j e^(gamma_(C-1) - gamma_j) k_j vn_j^T   (whole chunks only)

Why a row's bits do not depend on the schedule: every quantity of row i is a fixed sequence
of operations on tiles of one shape [C, ...], and each is row-local (row i of T, w, u, vn and
out reads only rows <= i of the tile and S); the rows after i enter only multiplied by an
exact zero (masked A, T and the decay). So row i gets the same bits whether the rows after it
hold this step's later rows (a prefill) or zeros (a decode step, or a prefill that ends at
row i). A product 0 * x is a zero whose sign follows x, so a sum that is exactly zero could
come out as -0 in one schedule and +0 in another; `+ 0.0` on the output makes every zero +0
(nothing but + and * lies between, and neither turns a zero's sign into a nonzero value). The
boundary state is computed only from a whole tile, one formula, the same inputs every time.

Contractions here are loops of multiply then add in ascending index (elementwise torch ops,
exact per element), so the CPU result is row-local by construction, whatever BLAS does with
a matrix's shape (plain CPU matmul is not M-invariant: docs/design.md, "CPU"). The GPU kernels
compute the same formulas with tl.dot and other sums: the two agree within rounding, not bits.
"""

from __future__ import annotations

import torch


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[H, M, K] @ [H, K, N] -> [H, M, N], each element summed over K in ascending order."""
    acc = a[:, :, 0:1] * b[:, 0:1, :]
    for j in range(1, a.shape[2]):
        acc = acc + a[:, :, j : j + 1] * b[:, j : j + 1, :]
    return acc


def chunk_tile(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk tile: state S [Hv, Dk, Dv] at the chunk's start, q, k [C, Hk, Dk], v [C, Hv,
    Dv], g, beta [C, Hv] (rows not present are zero) -> (out [C, Hv, Dv], the state after the
    tile's last row [Hv, Dk, Dv]). The module docstring states the formulas; the state is the
    boundary state when the tile is whole."""
    c, hk, _ = k.shape
    hv = v.shape[1]
    group = hv // hk
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hv, C, Dk]
    qh = q.transpose(0, 1).repeat_interleave(group, dim=0)
    vh, gh, bh = v.transpose(0, 1), g.t(), beta.t()  # [Hv, C, Dv], [Hv, C]
    gamma = torch.empty_like(gh)
    gamma[:, 0] = gh[:, 0]
    for r in range(1, c):  # one add per row, ascending
        gamma[:, r] = gamma[:, r - 1] + gh[:, r]
    rows = torch.arange(c, device=k.device)
    lower = rows[None, :] < rows[:, None]  # j < i
    causal = rows[None, :] <= rows[:, None]  # j <= i
    diff = gamma[:, :, None] - gamma[:, None, :]
    decay = torch.exp(torch.where(causal, diff, float("-inf")))
    kk = _dot(kh, kh.transpose(1, 2))
    a = torch.where(lower, (bh[:, :, None] * kk) * decay, 0.0)
    t = torch.eye(c, device=k.device).repeat(hv, 1, 1)
    for i in range(1, c):
        acc = a[:, i, 0:1] * t[:, 0, :]
        for j in range(1, i):
            acc = acc + a[:, i, j : j + 1] * t[:, j, :]
        t[:, i, :] = t[:, i, :] - acc
    t = torch.where(causal, t, 0.0)  # exact zeros above the diagonal
    eg = torch.exp(gamma)
    w = _dot(t, (bh * eg)[:, :, None] * kh)
    u = _dot(t, bh[:, :, None] * vh)
    vn = u - _dot(w, state)
    qk = _dot(qh, kh.transpose(1, 2))
    p = torch.where(causal, qk * decay, 0.0)
    out = eg[:, :, None] * _dot(qh, state) + _dot(p, vn)
    last = gamma[:, c - 1 :]  # [Hv, 1]
    kw = kh * torch.exp(last - gamma)[:, :, None]
    end = torch.exp(last)[:, :, None] * state + _dot(kw.transpose(1, 2), vn)
    return (out + 0.0).transpose(0, 1), end


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    open_k: torch.Tensor,
    open_v: torch.Tensor,
    open_g: torch.Tensor,
    open_beta: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """The rule over one sequence's rows at positions start .. start + n - 1 (q, k [n, Hk,
    Dk] L2-normalized, q scaled; v [n, Hv, Dv]; g, beta [n, Hv]; float32), continuing in place
    the boundary state S [Hv, Dk, Dv] of the chunk holding `start` and that chunk's earlier
    rows, as they arrived (open_k [C, Hk, Dk], open_v [C, Hv, Dv], open_g, open_beta [C, Hv];
    rows 0 .. start % C - 1 meaningful, C = open_k.shape[0]). Returns out [n, Hv, Dv] and
    (position, state) at every multiple of C in (start, start + n]."""
    n, chunk = q.shape[0], open_k.shape[0]
    out = torch.empty((n, v.shape[1], v.shape[2]), dtype=torch.float32, device=q.device)
    found: list[tuple[int, torch.Tensor]] = []
    i, p = 0, start
    while i < n:
        r0 = p % chunk
        m = min(n - i, chunk - r0)
        tiles = []
        for buf, rows in ((q, q), (open_k, k), (open_v, v), (open_g, g), (open_beta, beta)):
            tile = rows.new_zeros((chunk, *rows.shape[1:]), dtype=torch.float32)
            if buf is not q:  # queries of earlier rows are not needed: their outputs are out
                tile[:r0] = buf[:r0]
            tile[r0 : r0 + m] = rows[i : i + m]
            tiles.append(tile)
        tile_out, end = chunk_tile(state, *tiles)
        out[i : i + m] = tile_out[r0 : r0 + m]
        if r0 + m == chunk:
            state.copy_(end)
            found.append((p + m, end))
        else:
            for buf, rows in ((open_k, k), (open_v, v), (open_g, g), (open_beta, beta)):
                buf[r0 : r0 + m] = rows[i : i + m]
        i, p = i + m, p + m
    return out, found
