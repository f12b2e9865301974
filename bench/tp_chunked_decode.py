"""What the TP-invariant chunked reduction costs at TP 1 on one GPU: the linears of one decode
step on Qwen3-8B shapes (36 layers of qkv, o, gate-up and down, then the LM head; bf16 weights,
distinct per layer so the weights stream from HBM as in a real step), timed as CUDA-graph
replays at batch 1, 64 and 256, three ways:

    today            every linear is one `lockstep.ops.triton.matmul` (the kernels of today)
    chunked          o and down as the engine runs them at TP 1 (lockstep.parallel.layers):
                     8 chunk partials in float32 (one matmul per chunk over its K columns),
                     added in the fixed tree ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)), then bf16
    chunked_fused    o and down as one matmul with its K split at the same 8 points and the
                     splits folded in the kernel (`splits=8`; the fold is ascending, not the
                     tree: the cost a fused implementation of the chunking would have)

Attention is left out (the chunking does not touch it), so the cost is a share of the linears'
time, which is more than its share of a whole decode step. Also checks that `chunked` gives
the bits of the chunks computed on separate "ranks" (each chunk's matmul alone), i.e. that the
chunk partials do not depend on which chunks share a call.

    python -m bench.tp_chunked_decode [--batches 1,64,256] [--iters 50]   (repository root)

torch and triton only. Prints a table, then ONE JSON document on the last line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch

from lockstep.ops.triton import matmul as mm

LAYERS = 36
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 12288, 151936
CHUNKS = 8


def _tree(parts: list[torch.Tensor]) -> torch.Tensor:
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


class Layer:
    def __init__(self, gen: torch.Generator) -> None:
        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)

        self.qkv = w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        self.o = w(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up = w(2 * INTER, HIDDEN)
        self.down = w(HIDDEN, INTER)
        self.o_chunks = _chunks(self.o)
        self.down_chunks = _chunks(self.down)


def _chunks(weight: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    k = weight.shape[1]
    bounds = [(c * k // CHUNKS, (c + 1) * k // CHUNKS) for c in range(CHUNKS)]
    return [(lo, hi, weight[:, lo:hi].contiguous()) for lo, hi in bounds]


def _row_linear(x: torch.Tensor, weight: torch.Tensor, chunks, variant: str) -> torch.Tensor:
    if variant == "today":
        return mm.matmul(x, weight)
    if variant == "chunked_fused":
        return mm.matmul(x, weight, splits=CHUNKS)
    parts = [mm.matmul(x[:, lo:hi], w, out_dtype=torch.float32) for lo, hi, w in chunks]
    return _tree(parts).to(x.dtype)


def step(x: torch.Tensor, layers: list[Layer], head: torch.Tensor, variant: str) -> torch.Tensor:
    h = x
    for layer in layers:
        qkv = mm.matmul(h, layer.qkv)
        attn = qkv[:, : HEADS * HEAD_DIM].contiguous()  # stands in for attention's output
        h = h + _row_linear(attn, layer.o, layer.o_chunks, variant)
        gate, up = mm.matmul(h, layer.gate_up).chunk(2, dim=1)
        act = (torch.nn.functional.silu(gate.float()) * up.float()).to(h.dtype)
        h = h + _row_linear(act, layer.down, layer.down_chunks, variant)
    return mm.matmul(h, head, out_dtype=torch.float32)


def time_graph(fn, iters: int) -> float:
    """Milliseconds per replay of `fn` captured in a CUDA graph (after warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def check_chunk_bits(layer: Layer, m: int, gen: torch.Generator) -> bool:
    """Each chunk's partial computed in one call with the others' (TP 1) equals the chunk
    computed alone on its own (another rank): compared bitwise after the tree."""
    x = torch.randn(m, INTER, generator=gen, device="cuda").to(torch.bfloat16)
    together = _row_linear(x, layer.down, layer.down_chunks, "chunked")
    alone = [
        mm.matmul(x[:, lo:hi].contiguous(), w.clone(), out_dtype=torch.float32)
        for lo, hi, w in layer.down_chunks
    ]
    return bool(torch.equal(together, _tree(alone).to(x.dtype)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    mm.reserve_counters(torch.device("cuda"))
    layers = [Layer(gen) for _ in range(LAYERS)]
    head = (torch.randn(VOCAB, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5).to(
        torch.bfloat16
    )
    rows = []
    print(f"{'batch':>6} {'today ms':>10} {'chunked ms':>11} {'cost':>7} {'fused ms':>9} "
          f"{'cost':>7} {'bits':>5}")  # fmt: skip
    for m in batches:
        x = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        times = {
            v: time_graph(lambda v=v, x=x: step(x, layers, head, v), args.iters)
            for v in ("today", "chunked", "chunked_fused")
        }
        bits = check_chunk_bits(layers[0], m, gen)
        row = {
            "batch": m,
            "today_ms": times["today"],
            "chunked_ms": times["chunked"],
            "chunked_fused_ms": times["chunked_fused"],
            "chunked_cost": times["chunked"] / times["today"] - 1,
            "chunked_fused_cost": times["chunked_fused"] / times["today"] - 1,
            "chunk_bits_independent_of_call": bits,
        }
        rows.append(row)
        print(f"{m:>6} {row['today_ms']:>10.3f} {row['chunked_ms']:>11.3f} "
              f"{row['chunked_cost']:>+7.1%} {row['chunked_fused_ms']:>9.3f} "
              f"{row['chunked_fused_cost']:>+7.1%} {str(bits):>5}")  # fmt: skip
    doc = {
        "benchmark": "tp_chunked_decode",
        "shapes": "qwen3-8b linears (36 layers + LM head), bf16, CUDA-graph replays",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
