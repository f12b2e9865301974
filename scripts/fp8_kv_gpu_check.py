"""The FP8 KV cache on a GPU: where its bits come from, whether every decode path gives them,
and what a decode attention call costs, bf16 cache beside FP8 in one run.

    python scripts/fp8_kv_gpu_check.py [--engine] [--timing]

1. Widening: the kernels' e4m3 -> bf16 widening (`attention.widen_kv`, exact times
   2**-KV_WIDEN_EXP) of every finite e4m3 value, plain and as a dot operand scaled back the
   way attention's dots scale it (mma.sync tiles of 16 rows on 2 warps, wgmma tiles of 64 and
   128 rows; e4m3's subnormals become bf16 subnormals there), each against torch's conversion.
2. Paths: paged attention over 96 sequences of 1,000-2,100 keys (several splits), Qwen3-8B's
   heads, one query each, on every decode path (fold, split; slot ids a block ahead or not)
   and the prefill tiles, alone and among batch-mates; every row against the bf16 cache of
   the same (widened) values on the prefill tiles.
3. --engine: random:qwen3-8b, 64 requests decoded together against 4 of them alone, with the
   FP8 and the bf16 cache (CUDA graphs on).
4. --timing: one layer's decode attention at 64 sequences x 8,192 keys, per cache dtype and
   decode-tile variant, against the bytes it must read.
A table per part; one JSON document on the last line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lockstep.ops.base import build_attention_meta  # noqa: E402
from lockstep.ops.fp8 import E4M3, e4m3_sat  # noqa: E402
from lockstep.ops.triton.attention import (  # noqa: E402
    DEFAULT_CONFIG,
    KV_WIDEN_EXP,
    AttentionConfig,
    paged_attention,
    widen_kv,
)

DEV = "cuda"
WIDEN_EXP = int(KV_WIDEN_EXP.value)  # the widening scales by 2**-WIDEN_EXP
WIDE = tl.bfloat16  # the activation dtype the cache widens to (float32 under the interpreter)
HKV, G, D = 8, 4, 128
PROMPT_LO, PROMPT_HI, MATES = 600, 1500, 64  # --engine


@triton.jit
def _widen_plain(src, dst, N: tl.constexpr, WIDE: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst + offs, widen_kv(tl.load(src + offs), WIDE))


@triton.jit
def _widen_dot(
    src, dst_k, dst_v, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    WIDE: tl.constexpr, Q_ONE: tl.constexpr, P_ONE: tl.constexpr,
):  # fmt: skip
    """k [BLOCK_N, D] widened, read through two dots with one-hot rows: q @ k^T picks k's
    columns (k as the B operand, transposed, as attention's scores take it) and p @ v picks
    its rows (as attention's p @ V takes it). The hot entries are Q_ONE and P_ONE, the
    factors attention's q and p carry over a scaled widening; each output is one product
    plus zeros."""
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = widen_kv(tl.load(src + offs_n[:, None] * D + offs_d[None, :]), WIDE)
    r = pid * ROWS + tl.arange(0, ROWS)
    q = tl.where(offs_d[None, :] == r[:, None], Q_ONE, 0.0).to(WIDE)
    s = tl.dot(q, tl.trans(k))
    tl.store(dst_k + r[:, None] * BLOCK_N + offs_n[None, :], s, mask=r[:, None] < D)
    p = tl.where(offs_n[None, :] == r[:, None], P_ONE, 0.0).to(WIDE)
    o = tl.dot(p, k)
    tl.store(dst_v + r[:, None] * D + offs_d[None, :], o, mask=r[:, None] < BLOCK_N)


def widening() -> list[dict]:
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    vals = codes.view(E4M3).to(DEV)
    want = vals.to(torch.bfloat16)
    n = triton.next_power_of_2(vals.numel())
    padded = torch.zeros(n, dtype=E4M3, device=DEV)
    padded[: vals.numel()] = vals
    out = torch.empty(n, dtype=torch.bfloat16, device=DEV)
    _widen_plain[(1,)](padded, out, N=n, WIDE=WIDE)
    got = out[: vals.numel()].double() * 2.0**WIDEN_EXP
    rows = [{"variant": "plain", "differ": int((got != want.double()).sum())}]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vals.numel(), (64, D), generator=g)
    k8 = vals.cpu()[idx].to(DEV)
    ref = k8.float()
    for rows_, warps in ((16, 2), (64, 4), (128, 8)):
        dk = torch.full((D, 64), float("nan"), device=DEV)
        dv = torch.full((64, D), float("nan"), device=DEV)
        grid = (triton.cdiv(max(D, 64), rows_),)
        half = WIDEN_EXP // 2
        _widen_dot[grid](k8, dk, dv, ROWS=rows_, BLOCK_N=64, D=D, WIDE=WIDE, Q_ONE=2.0**half,
                         P_ONE=2.0**WIDEN_EXP, num_warps=warps)  # fmt: skip
        dk = dk.double() * 2.0**half  # q's factor leaves 2**-half on the scores
        rows.append({"variant": f"dot {rows_} rows / {warps} warps",
                     "differ": int((dk != ref.T).sum()) + int((dv != ref).sum())})  # fmt: skip
    return rows


def _problem(batch: int, lo: int, hi: int, seed: int):
    rng = random.Random(seed)
    ctx = [rng.randint(lo, hi) for _ in range(batch)]
    total = sum(ctx) + 64
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in ctx:
        tables.append(perm[at : at + n])
        at += n
    g = torch.Generator().manual_seed(seed + 1)
    k = e4m3_sat(torch.randn(total, HKV, D, generator=g) * 2).to(DEV)
    v = e4m3_sat(torch.randn(total, HKV, D, generator=g) * 2).to(DEV)
    q = (torch.randn(batch, HKV * G, D, generator=g)).to(DEV, torch.bfloat16)
    return ctx, tables, k, v, q


def paths() -> list[dict]:
    ctx, tables, k8, v8, q = _problem(96, 1000, 2100, seed=3)
    kb, vb = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    scale = D**-0.5

    def run(k, v, seqs, path, cfg):
        meta = build_attention_meta([1] * len(seqs), [ctx[s] - 1 for s in seqs],
                                    [tables[s] for s in seqs]).to(DEV)  # fmt: skip
        return paged_attention(q[seqs], k, v, meta, scale, cfg, path, torch.float32)

    every = list(range(len(ctx)))
    ref = run(kb, vb, every, "prefill", DEFAULT_CONFIG)
    ahead_on = AttentionConfig(slots_ahead_programs_per_sm=10**6)
    ahead_off = AttentionConfig(slots_ahead_split=False)
    rows = []
    for cache, (k, v) in (("fp8", (k8, v8)), ("bf16", (kb, vb))):
        for (path, cfg_name, cfg), seqs in itertools.product(
            [("prefill", "default", DEFAULT_CONFIG), ("fold", "ahead", ahead_on),
             ("fold", "no ahead", ahead_off), ("split", "ahead", ahead_on),
             ("split", "no ahead", ahead_off), (None, "default", DEFAULT_CONFIG)],
            (every, [0], every[5::12][:3]),
        ):  # fmt: skip
            out = run(k, v, seqs, path, cfg)
            differ = int((out != ref[seqs]).any(dim=-1).sum())
            rows.append({"cache": cache, "path": path or "auto", "variant": cfg_name,
                         "seqs": len(seqs), "rows_differ": differ,
                         "rows": out.shape[0] * out.shape[1]})  # fmt: skip
    return rows


def engine_check(model: str, device: str, dtype: str) -> list[dict]:
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from lockstep.engine.sampling_params import SamplingParams

    rows = []
    for kv_dtype in ("fp8_e4m3", "auto"):
        engine = Engine(EngineConfig(model=model, device=device, dtype=dtype,
                                     kv_dtype=kv_dtype, kv_tokens=160_000,
                                     max_model_len=4096))  # fmt: skip
        rng = random.Random(7)
        vocab = engine.decoder.spec.vocab_size
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        reqs = {f"r{i}": ([rng.randrange(vocab) for _ in range(rng.randint(PROMPT_LO, PROMPT_HI))], params)
                for i in range(MATES)}  # fmt: skip
        t0 = time.perf_counter()
        together = _generate(engine, reqs)
        first = {}
        for rid in ("r0", "r1", "r2", "r3"):
            engine.flush_cache()
            alone = _generate(engine, {rid: reqs[rid]})[rid]
            if alone != together[rid]:
                first[rid] = next(
                    i
                    for i, (a, b) in enumerate(zip(alone[1], together[rid][1], strict=True))
                    if a != b
                )
        rows.append({"kv_dtype": kv_dtype, "alone_checked": 4, "differ": len(first),
                     "first_differing_position": first, "seconds": time.perf_counter() - t0})  # fmt: skip
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _generate(engine, batch):
    for rid, (prompt, params) in batch.items():
        engine.add_request(rid, prompt, params)
    got = {rid: ([], []) for rid in batch}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_token_logprobs)
    return got


def _decode_problem(batch: int = 64, keys: int = 8192):
    """Decode rows of `batch` sequences of `keys` keys each, random slots: q, caches, meta."""
    total = batch * keys
    g = torch.Generator(device=DEV).manual_seed(0)
    kb = torch.randn(total, HKV, D, device=DEV, generator=g).to(torch.bfloat16)
    vb = torch.randn(total, HKV, D, device=DEV, generator=g).to(torch.bfloat16)
    k8, v8 = e4m3_sat(kb.float()), e4m3_sat(vb.float())
    q = torch.randn(batch, HKV * G, D, device=DEV, generator=g).to(torch.bfloat16)
    tables = torch.randperm(total, device="cpu").view(batch, keys)
    meta = build_attention_meta([1] * batch, [keys - 1] * batch, list(tables)).to(DEV)
    return q, (kb, vb), (k8, v8), meta


def profile(cache: str) -> None:
    """Three calls of the production decode path (the third one for a profiler to take:
    `ncu --launch-skip 2 --launch-count 1 -k regex:_attn_fwd`)."""
    q, bf16, fp8, meta = _decode_problem()
    k, v = fp8 if cache == "fp8" else bf16
    for _ in range(3):
        paged_attention(q, k, v, meta, D**-0.5)
    torch.cuda.synchronize()


def timing() -> list[dict]:
    batch, keys = 64, 8192
    total = batch * keys
    q, (kb, vb), (k8, v8), meta = _decode_problem(batch, keys)
    rows = []
    variants = [("default", DEFAULT_CONFIG)]
    for warps, stages, ahead in itertools.product((2, 4), (3, 5), (True, False)):
        variants.append((f"w{warps} s{stages} {'ahead' if ahead else 'plain'}", AttentionConfig(
            num_warps_split=warps, num_stages_split=stages,
            slots_ahead_programs_per_sm=10**6 if ahead else 1,
            slots_ahead_split=ahead)))  # fmt: skip
    # Other key blocks (part of the numerics: a cache dtype could take its own, prefill too).
    variants += [("bn32 w2", AttentionConfig(block_n=32)),
                 ("bn128 w4 s2", AttentionConfig(block_n=128, num_warps_split=4,
                                                 num_stages_split=2))]  # fmt: skip
    for cache, (k, v) in (("bf16", (kb, vb)), ("fp8", (k8, v8))):
        floor_ms = 2 * total * HKV * D * k.element_size() / 4.3e12 * 1e3
        for (name, cfg), path in itertools.product(variants, ("fold", "split")):
            if name != "default" and path == "split":
                continue
            try:
                ms = triton.testing.do_bench(
                    lambda k=k, v=v, cfg=cfg, path=path: paged_attention(
                        q, k, v, meta, D**-0.5, cfg, path),
                    warmup=25, rep=100, return_mode="median")  # fmt: skip
            except Exception as exc:  # a variant that does not compile: say so, go on
                rows.append({"cache": cache, "variant": name, "path": path, "error": str(exc)[:80]})
                continue
            rows.append({"cache": cache, "variant": name, "path": path, "ms": round(ms, 4),
                         "floor_ms": round(floor_ms, 4), "of_floor": round(floor_ms / ms, 3)})  # fmt: skip
    return rows


def register_sweep() -> list[dict]:
    """The 64 x 8k decode call (fold path) with Triton's register cap (`maxnreg`: more
    programs per SM) and fewer stages: speed-only launch options, checked equal to the
    default's output."""
    from lockstep.ops.triton import attention

    q, bf16, fp8, meta = _decode_problem()
    plain = attention._launch_opts
    rows = []
    for cache, (k, v) in (("bf16", bf16), ("fp8", fp8)):
        want = paged_attention(q, k, v, meta, D**-0.5)
        for maxnreg, stages, warps in itertools.product((None, 96, 128, 168), (2, 3), (2,)):
            cfg = AttentionConfig(num_stages_split=stages, num_warps_split=warps)

            def opts(*args, maxnreg=maxnreg):
                o = plain(*args)
                return o if maxnreg is None else {**o, "maxnreg": maxnreg}

            attention._launch_opts = opts
            try:
                same = torch.equal(paged_attention(q, k, v, meta, D**-0.5, cfg), want)
                ms = triton.testing.do_bench(
                    lambda cfg=cfg, k=k, v=v: paged_attention(q, k, v, meta, D**-0.5, cfg),
                    warmup=25, rep=100, return_mode="median")  # fmt: skip
            except Exception as exc:  # a variant that does not compile: say so, go on
                rows.append({"cache": cache, "maxnreg": maxnreg, "stages": stages,
                             "warps": warps, "error": str(exc)[:60]})  # fmt: skip
                continue
            finally:
                attention._launch_opts = plain
            rows.append({"cache": cache, "maxnreg": maxnreg, "stages": stages, "warps": warps,
                         "ms": round(ms, 4), "same_bits": same})  # fmt: skip
    return rows


def _table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--model", default="random:qwen3-8b", help="for --engine")
    parser.add_argument(
        "--profile",
        choices=("bf16", "fp8"),
        default=None,
        help="only run the 64 x 8k decode call 3 times (for a profiler)",
    )
    parser.add_argument(
        "--registers",
        action="store_true",
        help="only the 64 x 8k decode call's register-cap and stage sweep",
    )
    args = parser.parse_args()
    if args.profile:
        profile(args.profile)
        return
    if args.registers:
        _table(register_sweep())
        return
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    result = {"widening": widening()}
    _table(result["widening"])
    result["paths"] = paths()
    _table(result["paths"])
    if args.timing:
        result["timing"] = timing()
        _table(result["timing"])
    if args.engine:
        result["engine"] = engine_check(args.model, DEV, "bfloat16")
        _table(result["engine"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
