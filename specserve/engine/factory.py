"""Everything that touches files or devices to bring an engine up lives here, not in constructors."""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from specserve import envs
from specserve.config import EngineConfig, ModelConfig, SpecConfig
from specserve.distributed.parallel import SINGLE, TensorParallel, rank_model_config
from specserve.distributed.ranks import RankGroup, agree_min, rank0_value, start_ranks
from specserve.engine.engine import EngineCore
from specserve.engine.futures import FutureTokens
from specserve.engine.runner import ModelRunner
from specserve.engine.scheduler import Scheduler
from specserve.engine.tp_worker import StepSender, TargetForDrafting
from specserve.kv.pages import PageAllocator
from specserve.kv.prefix import PrefixCache
from specserve.kv.pool import allocate_kv_cache, dense_kv_bytes_per_token, kv_bytes_per_token, plan_num_pages
from specserve.layers.attention import decode_kernel_takes
from specserve.models.loader import build_model
from specserve.models.registry import model_config
from specserve.speculative import registry as speculative_registry
from specserve.speculative.plan import AdaptivePlan, expert_reads
from specserve.speculative.tiers import SglangTiers
from specserve.structured.grammar import Grammars

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# A CPU pool is capped so a laptop keeps its memory; --max-total-tokens or a GPU lifts this.
CPU_KV_BYTES_CAP = 2 * 2**30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    model_cfg: ModelConfig
    config_file: Path
    weights_dir: Path | None  # None: random weights
    tokenizer_dir: Path | None


def default_cache_root(config: EngineConfig) -> Path:
    return Path(config.cache_dir) if config.cache_dir else Path.home() / ".cache" / "specserve"


def shipped_config(name: str) -> Path | None:
    path = resources.files("specserve.model_configs") / f"{name}.json"
    return Path(str(path)) if path.is_file() else None


def resolve_model(config: EngineConfig) -> ResolvedModel:
    """Finds config, weights and tokenizer for `config.model_path`, converting a GGUF file once if needed."""
    path_str = config.model_path
    if path_str is None:
        from specserve.models.gguf import find_embedded_gguf

        path = _converted(find_embedded_gguf(), config)
        name = DEFAULT_MODEL_NAME
    else:
        path = Path(path_str).expanduser()
        name = path_str
        shipped = None if path.exists() else shipped_config(path_str)
        if shipped is not None:
            path = shipped
        if path.suffix == ".gguf":
            path = _converted(path, config)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    config_file = path if path.is_file() else path / "config.json"
    model_cfg = model_config(json.loads(config_file.read_text()))
    model_dir = config_file.parent
    weights_dir = None if config.load_format == "dummy" else model_dir
    return ResolvedModel(name, model_cfg, config_file, weights_dir, _tokenizer_dir(config, model_dir))


def _tokenizer_dir(config: EngineConfig, model_dir: Path) -> Path | None:
    """`--tokenizer-path` if given (it must hold a tokenizer), else the model's directory if it holds one."""
    tokenizer_dir = Path(config.tokenizer_path).expanduser() if config.tokenizer_path else model_dir
    if _has_tokenizer(tokenizer_dir):
        return tokenizer_dir
    if config.tokenizer_path:
        raise FileNotFoundError(f"--tokenizer-path {tokenizer_dir} holds no tokenizer.json or tokenizer_config.json")
    return None


def _has_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer.json").exists() or (directory / "tokenizer_config.json").exists()


def _converted(gguf_path: Path, config: EngineConfig) -> Path:
    from specserve.models.gguf import cached_conversion  # needs the gguf package; HF dirs don't

    return cached_conversion(gguf_path, default_cache_root(config))


def pick_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def pick_dtype(config: EngineConfig, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if model_cfg.torch_dtype == "float16" else torch.bfloat16


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(available, CPU_KV_BYTES_CAP)


def context_length(config: EngineConfig, model_cfg: ModelConfig) -> int:
    return min(config.context_length or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)


def build_engine_core(config: EngineConfig, progress: bool = True, record_layers: tuple[int, ...] = (),
                      ranks: RankGroup | None = None) -> tuple[EngineCore, ResolvedModel]:
    """`ranks`: this process's place in a tensor-parallel group, for ranks past 0 (engine/tp_worker.py); rank 0
    starts the group here when --tp-size asks for one."""
    resolved = resolve_model(config)
    model_cfg = resolved.model_cfg
    device = pick_device(config)
    if ranks is None and config.parallel.tp_size > 1:
        # The switches in force go with the config: every rank must take the same paths.
        ranks = start_ranks(config.parallel.tp_size, device, (config, envs.get()))
    if ranks is not None:
        device = ranks.device
        if device.type == "cuda":  # kernel choices timed at startup: every rank takes rank 0's
            from specserve.kernels.tuning import chooser

            # Rank 0's process may have decided shapes already (an engine built before this one): the others
            # start from its decisions, so every rank times the same shapes from here on.
            chooser.choice.best = rank0_value(ranks, chooser.choice.best)
            chooser.choice.agree = functools.partial(rank0_value, ranks)
    dtype = pick_dtype(config, model_cfg, device)
    max_model_len = context_length(config, model_cfg)
    torch.manual_seed(config.random_seed)
    algorithm = speculative_registry.algorithm(config.spec.algorithm) if config.spec.algorithm else None
    tp = TensorParallel(ranks.rank, ranks.size) if ranks is not None else SINGLE
    model = build_model(model_cfg, resolved.weights_dir, dtype, device, max_model_len, config.random_seed, progress,
                        tp=tp)
    rank_cfg = rank_model_config(model_cfg, tp)  # the heads this rank's KV pool holds
    draft = algorithm.load(config, model_cfg, dtype, device, max_model_len, progress) if algorithm else None
    page_size = config.cache.page_size
    target_per_token = kv_bytes_per_token(rank_cfg, dtype)
    per_token = target_per_token + (algorithm.bytes_per_token(draft, dtype) if draft else 0)
    max_bs = min(config.cuda_graph_max_bs, config.scheduler.max_running_requests)
    scratch = algorithm.target_scratch_slots(config, device, max_bs) if algorithm else 0
    num_pages = plan_num_pages(per_token, config.cache, free_memory_bytes(device) - scratch * per_token)
    if ranks is not None:
        num_pages = agree_min(ranks, num_pages)
    use_graphs = device.type == "cuda" and not config.disable_cuda_graph
    # With CUDA graphs or step programs, one extra page no request owns takes the KV of padded rows.
    pad_page = use_graphs or (algorithm is not None and algorithm.needs_pad_page(config, device))
    kv_cache = allocate_kv_cache(rank_cfg, (num_pages + pad_page) * page_size + scratch, dtype, device)
    num_slots = num_pages * page_size
    dense_per_token = dense_kv_bytes_per_token(rank_cfg, dtype)
    log.info("KV pool: %d tokens, %d bytes per token (the target's %s: %d%s)", num_slots, per_token,
             "latent" if model_cfg.mla else "keys and values", target_per_token,
             f"; expanded keys and values would be {dense_per_token}" if model_cfg.mla else "")
    rng = random.Random(config.random_seed)  # simulated acceptance's draws, in program and general path alike
    speculator = None
    if algorithm is not None:
        speculator = algorithm.build(config, draft, model if tp.size == 1 else TargetForDrafting(model), kv_cache,
                                     num_slots, max_bs, max_model_len, rng, capture=use_graphs, progress=progress)
    adaptive = draft_plan(config.spec, model_cfg) if speculator is not None and config.spec.adaptive else None
    allocator = PageAllocator(num_pages, page_size)
    scheduler = Scheduler(config.scheduler, allocator, max_model_len, *_draft_hooks(config, speculator, adaptive),
                          prefix_cache=PrefixCache(allocator) if config.cache.enable_prefix_caching else None,
                          draft_lead=speculator.proposer.drafter.shift if speculator is not None else 0,
                          draft_prune=_draft_prune(config, adaptive), forced_spans=not use_graphs)
    eos = model_cfg.eos_token_ids + _generation_eos(resolved.weights_dir or resolved.tokenizer_dir)
    proposer = speculator.proposer if speculator is not None else None
    futures = FutureTokens(config.scheduler.max_running_requests, device)
    graphs, untimed_gemv = None, contextlib.nullcontext
    if use_graphs:
        untimed_gemv = _decide_gemv_tiles(model, draft)
        from specserve.engine.graphs import DecodeGraphs

        # Steps that draft nothing replay the same graphs whether speculation is configured or not; an
        # EAGLE-3 head's taps are stored inside them, so turning drafting on later costs nothing extra.
        graphs = DecodeGraphs(model, kv_cache, num_slots, max_bs, max_model_len, page_size, progress, proposer,
                              record_layers, futures)
    runner = ModelRunner(model, kv_cache, device, futures, speculator, graphs, config.spec.simulate_accept_len,
                         rng, untimed_gemv)
    if ranks is not None:
        # Every rank samples and accepts the same tokens from the same logits only if their draws start alike.
        torch.manual_seed(config.random_seed)
        if ranks.rank == 0:
            runner.step_sender = StepSender(ranks)
    if device.type == "cuda":
        _warm_up_decode_kernel(rank_cfg, kv_cache, page_size)
        if proposer is not None:
            _warm_up_decode_kernel(proposer.drafter.attention_config, proposer.drafter.kv_cache, page_size)
    # On a CPU the "device" is the host itself, so overlapping would only cost the dropped tokens.
    overlap = device.type == "cuda" and not config.disable_overlap
    freeze_startup_objects()
    eos = tuple(dict.fromkeys(eos))
    engine = EngineCore(scheduler, runner, eos, overlap, adaptive, model_cfg.vocab_size,
                        _grammars(resolved.tokenizer_dir, model_cfg.vocab_size, eos) if ranks is None else
                        NoGrammarsUnderTP(), dense_per_token)
    return engine, resolved


class NoGrammarsUnderTP:
    """Structured output is refused at admission under tensor parallelism: the other ranks hold no grammar state,
    so their masks (drafts and verification alike) would not be rank 0's."""

    def state(self, constraint):
        raise ValueError("structured output is not served with --tp-size above 1")


def _grammars(tokenizer_dir, vocab_size: int, eos: tuple[int, ...]) -> Grammars | None:
    """Structured output's grammar compiler; it reads the tokenizer on the first constrained request."""
    if tokenizer_dir is None:
        return None

    def load():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer_dir))

    return Grammars(load, vocab_size, eos)


def freeze_startup_objects() -> None:
    """Moves every object alive now out of the garbage collector's view. The imports and the model's
    construction leave about a million objects that live as long as the process; a full collection walks
    them all, a long stall of the host that recurs through a busy serving run, and under overlap the
    device waits through it (docs/performance.md). Objects made while serving are collected as usual. What
    an earlier call froze is thawed and collected first, so an engine dropped before this one is built
    (evaluations and benchmarks build several in turn) is not kept alive by a reference cycle the collector no
    longer looks at."""
    thaw_and_collect()
    gc.freeze()


def thaw_and_collect() -> None:
    gc.unfreeze()
    gc.collect()


def _warm_up_decode_kernel(cfg: ModelConfig, kv_cache: torch.Tensor, page_size: int) -> None:
    """Eager calls of the decode kernel (decode rows of steps with prompts, the draft's catch-ups) would
    otherwise compile its forms inside serving steps."""
    # Other head dims take the PyTorch path, as does MLA (its latent cache is not the kernel's [2, slots, Hkv, D]).
    if decode_kernel_takes(cfg.head_dim) and cfg.mla is None:
        from specserve.kernels.triton import attention as triton_attention

        triton_attention.warm_up(cfg.num_heads, kv_cache[0], page_size)


def draft_plan(spec: SpecConfig, model_cfg: ModelConfig | None = None) -> AdaptivePlan | SglangTiers:
    """The adaptive plan that --speculative-policy names (docs/speculative.md), weighing a MoE target's expert
    reads in its cost estimates."""
    if spec.policy == "sglang-tiers":
        return SglangTiers(spec.num_steps, spec.max_drafts)
    return AdaptivePlan(spec.max_drafts, chains=spec.chain_lengths, depth=spec.num_steps, trees=spec.tree_sizes,
                        experts=expert_reads(model_cfg) if model_cfg is not None else None)


def _draft_prune(config: EngineConfig, adaptive):
    """The goodput plan's pruning of draft trees by their scores (under tensor parallelism each step carries
    the floor, so every rank searches the same trees). Not with simulated acceptance, which accepts a drawn
    depth along the tree: a tree pruned shallower caps it."""
    if (isinstance(adaptive, AdaptivePlan) and adaptive.choosing
            and config.spec.simulate_accept_len is None):
        return adaptive.draft_min_prob
    return None


def _draft_hooks(config: EngineConfig, speculator, adaptive: AdaptivePlan | SglangTiers | None) -> tuple:
    """The scheduler's draft plan, draft budget, step gate and follow gate (engine/scheduler.py): none without
    speculation; the adaptive plan's with --speculative-adaptive; else every step drafts the most it can."""
    max_drafts = config.spec.max_drafts
    if speculator is None:
        return None, max_drafts, None, None
    if adaptive is not None:
        return adaptive.num_drafts, max_drafts, adaptive.step_drafts, adaptive.drafting_pays
    return (lambda request: max_drafts), max_drafts, None, None


def _decide_gemv_tiles(*networks: torch.nn.Module | None):
    """Makes the GEMV choices of every weight at startup, where CUDA graphs capture them; returns the context
    in which a step's eager calls take cuBLAS for shapes still undecided rather than time them mid-step."""
    from specserve.kernels.tuning import chooser
    from specserve.layers.linear import decide_gemv_tiles

    with torch.inference_mode():
        for network in networks:
            if network is not None:
                decide_gemv_tiles(network)
    return chooser.choice.untimed


def _generation_eos(model_dir: Path | None) -> tuple[int, ...]:
    path = None if model_dir is None else model_dir / "generation_config.json"
    if path is None or not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
