"""One layer of reference paged attention for a step that mixes decode rows with a prefill chunk, SmolLM2-135M
shapes (9 query heads, 3 KV heads, head dim 64, fp32): every row padded to the chunk's length in one SDPA
call, against the short rows and the chunk attended in separate calls (what the engine does).

Usage: python benchmarks/mixed_step_attention.py [--out benchmarks/results/mixed_step_attention_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specserve.bench.decode import hardware_info
from specserve.layers import attention
from specserve.layers.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16
CASES = [(8, 300, 512), (32, 400, 256)]  # decode rows, their context, prefill chunk tokens


def _time_ms(fn, repeats: int = 5) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


def measure(rows: int, context: int, chunk: int) -> dict:
    query_lens, starts = [1] * rows + [chunk], [context] * rows + [0]
    pages, next_page = [], 0
    for q, s in zip(query_lens, starts):
        need = -(-(q + s) // PAGE)
        pages.append(list(range(next_page, next_page + need)))
        next_page += need
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, next_page * PAGE, KV_HEADS, DIM, generator=g)
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    k, v = torch.randn(2, tokens, KV_HEADS, DIM, generator=g)
    result = {"decode_rows": rows, "context": context, "prefill_chunk": chunk}
    default = attention.SHORT_QUERY
    for label, short in (("one_padded_call_ms", 10**9), ("split_calls_ms", default)):
        attention.SHORT_QUERY = short
        meta = AttentionMetadata.build(query_lens, starts, pages, PAGE, torch.device("cpu"))
        result[label] = _time_ms(lambda: paged_attention(q, k, v, cache, meta, DIM ** -0.5))
    attention.SHORT_QUERY = default
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = [measure(*case) for case in CASES]
    for r in results:
        print(f"{r['decode_rows']} decode rows (context {r['context']}) + a {r['prefill_chunk']}-token chunk: "
              f"one padded call {r['one_padded_call_ms']:.1f} ms, split {r['split_calls_ms']:.1f} ms per layer")
    report = {"benchmark": "mixed_step_attention", "hardware": hardware_info(), "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
