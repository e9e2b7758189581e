"""`specserve bench decode` as a script, plus `--profile`: where one decode step's time goes, specserve vs HF.

Docs figures it reproduces: plain decode of the embedded SmolLM2-135M on the CPU against Hugging Face
`generate` (the same as `specserve bench decode --device cpu`); with --profile, where a step's time goes.

    python benchmarks/decode_cpu.py [bench decode flags]             # same as `specserve bench decode`
    python benchmarks/decode_cpu.py --profile [--batch-sizes 1 8]    # phases, torch.profiler and cProfile of steps
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from specserve.cli import build_parser, engine_config
from specserve.bench.decode import make_prompts
from specserve import SamplingParams

PROFILE_STEPS = 32


def profile_specserve(llm, prompts: list[list[int]], output_len: int) -> None:
    from specserve.engine.phases import PhaseTimer

    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof-{id(prompts)}-{i}", p, params)
    engine.step()  # prefill, not profiled
    for _ in range(4):  # warm decode steps
        engine.step()
    timer = PhaseTimer(torch.device("cpu"))
    engine.time_phases(timer)  # each step split into its phases (engine/phases.py)
    for _ in range(PROFILE_STEPS):
        engine.step()
    print("specserve per step: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in timer.per_step_ms().items()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILE_STEPS):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(PROFILE_STEPS):
        engine.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20)
    print(s.getvalue())
    while engine.has_work():
        engine.step()


def profile_hf(model, prompts: list[list[int]]) -> None:
    # generate()'s decode loop is model.forward with a KV cache plus argmax; reproduce it to profile steps only.
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(4):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILE_STEPS):
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        print(f"HF per step (under profiler): {(time.perf_counter() - t0) / PROFILE_STEPS * 1e3:.2f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main(argv: list[str]) -> int:
    profile = "--profile" in argv
    args = build_parser().parse_args(["bench", "decode", *[a for a in argv if a != "--profile"]])
    if not profile:
        from specserve.bench.decode import run_decode_bench

        run_decode_bench(engine_config(args), args)
        return 0
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from specserve import LLM

    cfg = engine_config(args)
    cfg = replace(cfg, device="cpu") if cfg.device == "auto" else cfg
    llm = LLM(config=cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_info.weights_dir), dtype=torch.float32).eval()
    print(f"torch threads {torch.get_num_threads()}")
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, llm.model_info.model_cfg.vocab_size, cfg.random_seed + batch)
        print(f"\n===== batch {batch}: specserve =====")
        profile_specserve(llm, prompts, args.output_len)
        print(f"\n===== batch {batch}: HF =====")
        profile_hf(hf, prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
