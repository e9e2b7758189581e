"""Command line: the only place that reads argv. Flag names follow SGLang's where one exists."""
from __future__ import annotations

import argparse
import sys

from specserve.speculative import registry as speculative_registry
from specserve.config import (
    SPEC_POLICIES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
)
from specserve.config import ROUTER_POLICIES, ScaleOutConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model-path", "--model", dest="model_path", default=None,
                   help="HF directory, .gguf file, or a shipped config name (e.g. llama-3.1-8b with "
                        "--load-format dummy). Default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--tokenizer-path", default=None,
                   help="a directory with the tokenizer (tokenizer.json, its config and chat template). Default: "
                        "the model's; a shipped config with --load-format dummy has none")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--random-seed", type=int, default=0)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--mem-fraction-static", type=float, default=0.85)
    g.add_argument("--max-total-tokens", type=int, default=None, help="cap on tokens held in the KV pool")
    g.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", default=True,
                   help="share the KV of repeated prompt prefixes between requests, draft KV included (default)")
    g.add_argument("--disable-radix-cache", "--no-enable-prefix-caching", dest="prefix_caching",
                   action="store_false", help="compute every prompt from scratch")
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--max-queued-requests", type=int, default=1024)
    g.add_argument("--chunked-prefill-size", type=int, default=2048, help="tokens computed per step")
    g.add_argument("--cache-dir", default=None, help="where converted GGUF models are kept")
    g.add_argument("--disable-cuda-graph", action="store_true", help="run every GPU step eagerly")
    g.add_argument("--cuda-graph-max-bs", type=int, default=256, help="largest decode batch captured in a graph")
    g.add_argument("--disable-overlap", "--disable-overlap-schedule", dest="disable_overlap", action="store_true",
                   help="read each GPU step back before preparing the next")
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                   help="tensor parallelism: shard the model over this many GPUs, one process each (gloo ranks "
                        "on a CPU)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-algorithm", default=None, choices=[*speculative_registry.ALGORITHMS, "NONE"],
                   help="default: EAGLE3 with the bundled head for the embedded default model, else none")
    s.add_argument("--speculative-draft-model-path", default=None,
                   help="EAGLE3: a head in the public EAGLE-3 format; DRAFT_MODEL: a smaller HF causal LM")
    s.add_argument("--speculative-num-steps", type=int, default=None,
                   help="levels of the draft tree (chain depth); default 3, or the bundled head's setting")
    s.add_argument("--speculative-eagle-topk", type=int, default=None,
                   help="children per node; 1 (the default) drafts a chain")
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="tokens verified per request per step, root included (default: steps * topk + 1)")
    s.add_argument("--speculative-adaptive", dest="speculative_adaptive", action="store_true", default=None,
                   help="draft only in steps and for requests where it pays, by measured step cost and "
                        "acceptance (default for serve and generate; in benchmarks every step drafts unless "
                        "given it)")
    s.add_argument("--disable-speculative-adaptive", dest="speculative_adaptive", action="store_false",
                   help="draft in every decode step with no prompt pending")
    s.add_argument("--speculative-policy", default=None, choices=SPEC_POLICIES,
                   help="what the adaptive plan chooses (implies --speculative-adaptive): on-off (the default) "
                        "drafts the configured shape or nothing; goodput also picks shorter chains and smaller "
                        "trees by measured step cost and acceptance by draft position, and prunes trees by "
                        "their draft scores; sglang-tiers is SGLang's batch-size tiers "
                        "with an acceptance EMA, a baseline")
    s.add_argument("--speculative-draft-model-quantization", default=None, choices=["fp8"],
                   help="EAGLE3: the head's projections in fp8, weight-only (half the bytes a draft step of at "
                        "most 16 rows reads; the output is still verified by the target)")
    s.add_argument("--speculative-simulate-accept-len", type=float, default=None,
                   help="speed studies only: accept drafts at random with this mean acceptance length; the "
                        "output is not the model's and is labelled simulated")


def engine_config(args: argparse.Namespace, bundled_head: bool = False) -> EngineConfig:
    """`bundled_head`: the embedded default model drafts with its shipped head unless flags say otherwise
    (serve and generate; benchmarks measure exactly what their flags ask for)."""
    return EngineConfig(
        model_path=args.model_path,
        load_format=args.load_format,
        tokenizer_path=args.tokenizer_path,
        dtype=args.dtype,
        device=args.device,
        context_length=args.context_length,
        random_seed=args.random_seed,
        cache_dir=args.cache_dir,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_overlap=args.disable_overlap,
        cache=CacheConfig(args.page_size, args.mem_fraction_static, args.max_total_tokens, args.prefix_caching),
        scheduler=SchedulerConfig(args.max_running_requests, args.chunked_prefill_size, args.max_queued_requests),
        spec=spec_config(args, bundled_head),
        parallel=ParallelConfig(args.tp_size),
    )


def spec_config(args: argparse.Namespace, bundled_head: bool = False) -> SpecConfig:
    """The embedded default model ships a trained head: EAGLE3 without a head path uses it, and with
    `bundled_head` it is on unless --speculative-algorithm NONE. On a GPU the head stays off by default: its
    chain steps pay at batch 1 but lose under many concurrent conversations, and the adaptive plan has run
    there only with simulated acceptance (docs/speculative.md). With `bundled_head` (serve, generate),
    drafting adapts unless --disable-speculative-adaptive; benchmarks draft every step unless
    --speculative-adaptive."""
    from specserve import draft_heads

    algorithm, head = args.speculative_algorithm, args.speculative_draft_model_path
    steps, topk = args.speculative_num_steps, args.speculative_eagle_topk
    embedded = args.model_path is None and args.load_format != "dummy"
    if algorithm is None and bundled_head and embedded and _runs_on_cpu(args):
        algorithm = "EAGLE3"
    if algorithm in (None, "NONE"):  # (a quantization asked for then is an error: SpecConfig says so)
        return SpecConfig(draft_model_quantization=args.speculative_draft_model_quantization)
    if algorithm == "EAGLE3" and embedded and head is None:
        head = str(draft_heads.SMOLLM2_HEAD)
        steps = draft_heads.SMOLLM2_DEFAULT_STEPS if steps is None else steps
        topk = draft_heads.SMOLLM2_DEFAULT_TOPK if topk is None else topk
    adaptive = args.speculative_adaptive
    if adaptive is None:
        adaptive = bundled_head or args.speculative_policy is not None
    return SpecConfig(algorithm, head, 3 if steps is None else steps, 1 if topk is None else topk,
                      args.speculative_num_draft_tokens, args.speculative_simulate_accept_len, adaptive,
                      args.speculative_draft_model_quantization, args.speculative_policy or "on-off")


def _runs_on_cpu(args: argparse.Namespace) -> bool:
    from specserve.engine.factory import pick_device

    return pick_device(EngineConfig(device=args.device)).type == "cpu"


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", "--model-path", dest="model_path", default=None,
                   help="the target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)


def _target_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model_path=args.model_path, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir,
                        cache=CacheConfig(max_total_tokens=args.max_total_tokens),
                        scheduler=SchedulerConfig(max_running_requests=args.max_running_requests,
                                                  chunked_prefill_size=args.chunked_prefill_size))


def _numbers(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    from specserve.bench.sweep import DEFAULT_CONCURRENCY

    m = p.add_argument_group("what to load")
    m.add_argument("--base-url", default=None, help="an OpenAI-compatible server: specserve, SGLang or vLLM")
    m.add_argument("--api-key", default=None)
    m.add_argument("--offline", action="store_true", help="run the engine in this process instead (engine flags apply)")
    m.add_argument("--compare", nargs="+", default=None, metavar="JSONL", help="overlay saved runs; no load is sent")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=_numbers(int), default=DEFAULT_CONCURRENCY,
                      help="comma-separated levels (closed loop)")
    load.add_argument("--request-rate", type=_numbers(float), default=None,
                      help="comma-separated Poisson arrival rates (req/s) instead of concurrency levels")
    load.add_argument("--num-prompts", type=int, default=None, help="requests per level (default max(50, 4C))")
    load.add_argument("--waves", type=int, default=None,
                      help="requests per concurrency level: this many times C (--num-prompts, where given, wins)")
    load.add_argument("--dataset", default="sharegpt",
                      help="sharegpt | mt-bench | json-schema (replies under JSON schemas) | random | a JSONL file")
    load.add_argument("--random-input-len", type=int, default=512)
    load.add_argument("--random-output-len", type=int, default=256)
    load.add_argument("--random-vocab-size", type=int, default=32000, help="token ids of random prompts stay below this")
    load.add_argument("--max-tokens", type=int, default=None, help="default: the dataset's answer length, else 256")
    load.add_argument("--ignore-eos", action="store_true")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--api", choices=["chat", "completions"], default="chat")
    load.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("output")
    out.add_argument("--out", default=None, help="JSONL file for the records (the plot goes next to it)")
    out.add_argument("--label", default=None, help="this run's name in tables and plots")
    out.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--api-key", default=None, help="require this bearer token (or set SPECSERVE_API_KEY)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds to let requests in flight finish (0: end them at once)")
    serve.add_argument("--max-request-body-bytes", type=_at_least(1), default=4 * 1024 * 1024,
                       help="larger request bodies get a 413 before they are read")
    serve.add_argument("--request-read-timeout", type=float, default=30.0,
                       help="seconds a request's headers, then its body, may take to arrive; then the connection "
                            "is closed (a body gets a 408)")
    serve.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=_at_least(1), default=1,
                       help="run this many replica servers (one per --tp-size GPUs, or a share of the CPU cores "
                            "each) behind the smg gateway on --host/--port (needs specserve[router])")
    serve.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                       help="with --dp-size: smg's routing policy")

    gen = sub.add_parser("generate", help="generate offline from prompts given on the command line")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")

    train = sub.add_parser("train-draft", help="train an EAGLE-3 head for a target by self-distillation")
    _add_target_args(train)
    train.add_argument("--out", required=True, help="directory for the head, its data and checkpoints")
    train.add_argument("--data", default="sharegpt",
                       help="sharegpt (first turns) | sharegpt-turns (every distinct human turn) | mt-bench | "
                            "a JSONL of prompts or conversations")
    train.add_argument("--num-prompts", type=int, default=4000)
    train.add_argument("--max-tokens", type=int, default=512, help="answer length when regenerating")
    train.add_argument("--temperature", type=float, default=0.0)
    train.add_argument("--draft-vocab-size", type=int, default=16384)
    train.add_argument("--steps", type=int, default=2000)
    train.add_argument("--train-minutes", type=float, default=None,
                       help="set --steps from the speed measured in warm-up so training takes this long")
    train.add_argument("--stop-after-minutes", type=float, default=None,
                       help="checkpoint and exit after this long; the same command resumes")
    train.add_argument("--gen-batch", type=_at_least(1), default=256,
                       help="prompts each engine generates at a time (one data shard each)")
    train.add_argument("--dp-size", type=_at_least(1), default=1,
                       help="engines generating the data side by side on the device, each with 1/N of the "
                            "running requests and KV pool (a small target is bound by one engine's CPU work)")
    train.add_argument("--eval-samples", type=_at_least(0), default=256,
                       help="samples kept out of training (at most a tenth); their agreement is measured at "
                            "every checkpoint, since the training batches' own agreement includes memorizing")
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--max-len", type=int, default=1024)
    train.add_argument("--lr", type=float, default=1e-4)
    train.add_argument("--warmup-steps", type=int, default=50)
    train.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll depth")
    train.add_argument("--step-decay", type=float, default=0.8, help="unroll step k's loss weighs this**k")
    train.add_argument("--length-pool", type=_at_least(1), default=64,
                       help="batches are cut from this many batches' worth of shuffled samples sorted by "
                            "length, so they pad little (1: random batches)")
    train.add_argument("--checkpoint-every", type=int, default=200)
    train.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    train.add_argument("--max-shard-mib", type=int, default=16, help="split the saved head into shards this large")
    train.add_argument("--seed", type=int, default=0)

    evaluate = sub.add_parser("eval-draft", help="acceptance length and tok/s of an EAGLE-3 head, greedy")
    _add_target_args(evaluate)
    evaluate.add_argument("--draft", required=True, help="EAGLE-3 head directory")
    evaluate.add_argument("--data", default="mt-bench", help="mt-bench (both turns) or a JSONL of prompts")
    evaluate.add_argument("--num-questions", type=int, default=None)
    evaluate.add_argument("--max-tokens", type=int, default=256)
    evaluate.add_argument("--chain-steps", type=int, default=5)
    evaluate.add_argument("--tree", type=int, nargs=3, action="append", default=None,
                          metavar=("TOPK", "STEPS", "TOKENS"),
                          help="a tree setting (default 4 8 16); repeat the flag to compare several in one run")
    evaluate.add_argument("--concurrency", type=int, default=1,
                          help="conversations decoded together (tok/s is then batch throughput)")
    evaluate.add_argument("--out", default=None, help="write the results JSON here")

    bench = sub.add_parser("bench", help="benchmarks: serving sweeps (online, offline, compare), decode, spec")
    add_sweep_args(bench)
    add_engine_args(bench)
    bench_sub = bench.add_subparsers(dest="bench", required=False)
    decode = bench_sub.add_parser("decode", help="greedy decode tok/s vs Hugging Face generate")
    add_engine_args(decode)
    decode.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    decode.add_argument("--prompt-len", type=int, default=128)
    decode.add_argument("--output-len", type=int, default=128)
    decode.add_argument("--repeats", type=int, default=3)
    decode.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    decode.add_argument("--count-experts", action="store_true",
                        help="MoE targets: report the distinct experts each layer touches per step")
    decode.add_argument("--out", default=None, help="write results JSON here")
    spec = bench_sub.add_parser("spec", help="speculative decode tok/s and acceptance vs no speculation")
    add_engine_args(spec)
    spec.add_argument("--num-steps", type=int, nargs="+", default=[1, 3, 5], help="chain lengths to run")
    spec.add_argument("--tree", type=int, nargs=3, default=[4, 5, 16], metavar=("TOPK", "STEPS", "TOKENS"),
                      help="the tree shape to run")
    spec.add_argument("--draft-vocab-size", type=int, default=16384, help="draft vocabulary of the random head")
    spec.add_argument("--prompt-len", type=int, default=128)
    spec.add_argument("--output-len", type=int, default=128)
    spec.add_argument("--repeats", type=int, default=2)
    spec.add_argument("--count-experts", action="store_true",
                      help="MoE targets: report the distinct experts each layer touches per plain and drafting step")
    spec.add_argument("--out", default=None, help="write results JSON here")
    structured = bench_sub.add_parser("structured", help="JSON-schema outputs: tok/s and acceptance, constrained "
                                                        "vs free, speculation off, chain and tree")
    add_engine_args(structured)
    structured.add_argument("--head", default=None, help="EAGLE-3 head for the chain and tree rows (default: "
                                                         "the bundled SmolLM2 head for the bundled model; 'random': a "
                                                         "random head, with --load-format dummy; none: no "
                                                         "speculation rows)")
    structured.add_argument("--tree", type=int, nargs=3, default=[2, 3, 6], metavar=("TOPK", "STEPS", "TOKENS"))
    structured.add_argument("--batch-size", type=int, default=None,
                            help="requests in flight: the suite cycled to four times as many, each one that "
                                 "finishes replaced by the next (default: the suite as one batch)")
    structured.add_argument("--host-profile", action="store_true",
                            help="per configuration, one more constrained run with overlap under cProfile: the "
                                 "host's functions by their own time, in the report")
    structured.add_argument("--max-tokens", type=int, default=160)
    structured.add_argument("--repeats", type=int, default=1, help="runs of each constrained row (overlap off "
                                                                   "and on, alternating; the median is reported)")
    structured.add_argument("--out", default=None, help="write results JSON here")
    turns = bench_sub.add_parser("multi-turn", help="conversations replayed turn by turn, prefix caching on and off")
    add_engine_args(turns)
    turns.add_argument("--data", default="mt-bench", help="mt-bench (two turns) | sharegpt | a JSONL with \"turns\"")
    turns.add_argument("--num-conversations", type=int, default=10)
    turns.add_argument("--concurrency", type=int, default=1, help="conversations replayed together")
    turns.add_argument("--max-tokens", type=int, default=128)
    turns.add_argument("--out", default=None, help="write results JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve" and args.dp_size > 1:
        return _serve_replicas(args, sys.argv[1:] if argv is None else argv)
    if args.command == "serve":
        from specserve import envs
        from specserve.server.launch import serve

        # The key may come from the environment, where `ps` does not show it.
        serve(ServerConfig(args.host, args.port, args.api_key or envs.get().api_key or None, args.served_model_name,
                           engine_config(args, bundled_head=True), shutdown_timeout=args.shutdown_timeout,
                           max_request_body_bytes=args.max_request_body_bytes,
                           request_read_timeout=args.request_read_timeout))
    elif args.command == "generate":
        return _generate(args)
    elif args.command == "bench" and args.bench == "decode":
        from specserve.bench.decode import run_decode_bench

        run_decode_bench(engine_config(args), args)
    elif args.command == "bench" and args.bench == "multi-turn":
        from specserve.bench.multiturn import run_multi_turn_bench

        run_multi_turn_bench(engine_config(args), args)
    elif args.command == "bench" and args.bench == "structured":
        from specserve.bench.structured import run_structured_bench

        config = engine_config(args)
        if args.head is None and config.model_path is None:
            from specserve import draft_heads

            args.head = str(draft_heads.SMOLLM2_HEAD)
        run_structured_bench(config, args)
    elif args.command == "bench" and args.bench == "spec":
        from specserve.bench.spec import run_spec_bench

        run_spec_bench(engine_config(args), args)
    elif args.command == "bench":
        return _sweep(args)
    elif args.command == "train-draft":
        from specserve.train.run import run_train_draft

        run_train_draft(_target_config(args), args)
    elif args.command == "eval-draft":
        from specserve.train.run import run_eval_draft

        run_eval_draft(_target_config(args), args)
    return 0


def _serve_replicas(args: argparse.Namespace, argv: list[str]) -> int:
    from specserve import envs
    from specserve.server.replicas import serve_replicas

    server = ServerConfig(args.host, args.port, args.api_key or envs.get().api_key or None, args.served_model_name,
                          shutdown_timeout=args.shutdown_timeout)
    serve_argv = argv[argv.index("serve") + 1:]
    return serve_replicas(server, ScaleOutConfig(args.dp_size, args.router_policy), serve_argv,
                          on_cpu=_runs_on_cpu(args), gpus_per_replica=args.tp_size)


def _sweep(args: argparse.Namespace) -> int:
    from specserve.bench import sweep
    from specserve.bench.report import BenchError

    try:
        if args.compare:
            sweep.run_compare(args)
        elif args.offline:
            sweep.run_offline(engine_config(args), args)
        elif args.base_url:
            sweep.run_online(args)
        else:
            raise BenchError("say what to measure: --base-url URL, --offline, or --compare A.jsonl B.jsonl")
    except (BenchError, FileNotFoundError, ValueError) as err:
        print(f"specserve bench: error: {err}", file=sys.stderr)
        return 2
    return 0


def _generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.core import SamplingParams

    llm = LLM(config=engine_config(args, bundled_head=True), progress=True)
    prompts = args.prompts
    if args.chat:
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    for out in llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)):
        print(out.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
