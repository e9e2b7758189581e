"""Host time of the step description under tensor parallelism (specserve/distributed/steps.py): what rank 0
spends encoding each step and packing it into the broadcast buffer, and what every other rank spends unpacking
and decoding it, on the CPU, single-threaded. The broadcast itself is left out (replaced by a no-op, one
process plays both sides), so the figures are the host work alone.

Decode steps of 1, 64 and 256 sequences, each holding about 128 pages (page size 16, so a 2k-token context),
greedy, one token per sequence per step: every sequence gains a page every 16 steps, staggered so that some
grow in each step, as in a running server. The first step (which sends every table whole) is left out of the
medians and reported apart. Every decoded batch is checked against the one encoded.

`--base REV` measures that revision's steps.py too, interleaved with this tree's, for a before/after table
(revisions before page-table changes had module-level `encode` and `decode`).

    python benchmarks/step_description_cpu.py --base 2693623 --out benchmarks/results/step_description_cpu.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specserve.bench.decode import hardware_info
from specserve.core import SamplingParams, ScheduledSeq, StepBatch
from specserve.distributed import steps as current

PAGE_SIZE, PAGES = 16, 128
GREEDY = SamplingParams(temperature=0.0)
ROOT = Path(__file__).resolve().parents[1]


def decode_steps(num_seqs: int, steps: int):
    """The batches of `steps` decode steps, as the scheduler builds them (each table a fresh list)."""
    positions = [PAGES * PAGE_SIZE - 1 - (i * 7) % PAGE_SIZE for i in range(num_seqs)]
    tables = [list(range(i * 1000, i * 1000 + PAGES)) for i in range(num_seqs)]
    for step in range(steps):
        seqs = []
        for i in range(num_seqs):
            if positions[i] >= len(tables[i]) * PAGE_SIZE:
                tables[i].append(i * 1000 + len(tables[i]))
            seqs.append(ScheduledSeq(f"r{i}", [5], positions[i], list(tables[i]), GREEDY, True, None,
                                     output_index=step, num_prompt_tokens=100))
            positions[i] += 1
        yield StepBatch(seqs, PAGE_SIZE)


def codec(module):
    """(encode, decode) of a steps module: its encoder and decoder objects, or a revision's module functions."""
    if hasattr(module, "StepEncoder"):
        return module.StepEncoder().encode, module.StepDecoder().decode
    return module.encode, module.decode


def measure(module, num_seqs: int, steps: int) -> dict:
    encode, decode = codec(module)
    channel = module.StepChannel(None)
    times = {part: [] for part in ("encode", "pack", "unpack", "decode")}
    words = []
    for batch in decode_steps(num_seqs, steps):
        t0 = time.perf_counter()
        sent = encode(batch)
        t1 = time.perf_counter()
        channel.send(sent)
        t2 = time.perf_counter()
        channel.receive()  # a no-op broadcast: the words past the buffer are not the sent ones
        t3 = time.perf_counter()
        got = decode(list(sent)).batch
        t4 = time.perf_counter()
        assert [s.page_ids for s in got.seqs] == [s.page_ids for s in batch.seqs]
        for part, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[part].append(seconds)
        words.append(len(sent))
    row = {"sequences": num_seqs, "pages_per_sequence": PAGES, "first_step_words": words[0],
           "words": int(statistics.median(words[1:])),
           "broadcasts": 1 + (statistics.median(words[1:]) > module.CAPACITY)}
    for part, seconds in times.items():
        row[f"{part}_ms"] = round(statistics.median(seconds[1:]) * 1e3, 4)
    row["rank0_ms"] = round(row["encode_ms"] + row["pack_ms"], 4)
    row["worker_ms"] = round(row["unpack_ms"] + row["decode_ms"], 4)
    return row


def load_revision(revision: str):
    source = subprocess.run(["git", "show", f"{revision}:specserve/distributed/steps.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "base_steps.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_steps", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_steps"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", default="1,64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each version, interleaved; medians")
    parser.add_argument("--base", help="a revision to measure beside this tree")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    versions = {"this tree": current}
    if args.base:
        versions = {f"base {args.base}": load_revision(args.base), **versions}
    for module in versions.values():
        module.dist.broadcast = lambda *a, **k: None  # one process: time the host work only
    hardware = hardware_info()
    rows = []
    for n in map(int, args.sequences.split(",")):
        runs = {name: [] for name in versions}
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
            for name, module in versions.items():
                runs[name].append(measure(module, n, args.steps))
        for name, measured in runs.items():
            row = {"version": name, **{k: statistics.median(r[k] for r in measured) for k in measured[0]}}
            rows.append(row)
            print(row, flush=True)
    hardware["loadavg_at_end"] = os.getloadavg()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "step_description_cpu", "revision": revision, "hardware": hardware,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
