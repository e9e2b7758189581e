"""Everything that touches files or devices to bring an engine up lives here, not in constructors."""
from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from specserve.config import EngineConfig, ModelConfig
from specserve.engine.engine import EngineCore
from specserve.kv.pages import PageAllocator
from specserve.engine.runner import ModelRunner
from specserve.kv.pool import allocate_kv_cache, kv_bytes_per_token, plan_num_pages
from specserve.engine.scheduler import Scheduler
from specserve.layers.attention import decode_kernel_takes
from specserve.models.eagle3 import Eagle3Head
from specserve.models.loader import build_model, load_eagle3_head
from specserve.speculative.drafters.base import DraftModelDrafter, Eagle3Drafter
from specserve.speculative.plan import AdaptivePlan
from specserve.speculative.search import TreeProposer, scratch_slots

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# A CPU pool is capped so a laptop keeps its memory; --max-total-tokens or a GPU lifts this.
CPU_KV_BYTES_CAP = 2 * 2**30
RANDOM_HEAD_LOGIT_STD = 10.0
# Tree steps as one program on a CPU too (tests check the program there; serving keeps the general search,
# which measured 1.7x the program's speed on 2 cores, where a read-back costs nothing).
TREE_PROGRAM_ON_CPU = False
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
    model_cfg = ModelConfig.from_hf_config(json.loads(config_file.read_text()))
    model_dir = config_file.parent
    has_tokenizer = (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists()
    weights_dir = None if config.load_format == "dummy" else model_dir
    return ResolvedModel(name, model_cfg, config_file, weights_dir, model_dir if has_tokenizer else None)


def _converted(gguf_path: Path, config: EngineConfig) -> Path:
    from specserve.models.gguf import cached_conversion# needs the gguf package; HF dirs don't

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


def build_engine_core(config: EngineConfig, progress: bool = True,
                      record_layers: tuple[int, ...] = ()) -> tuple[EngineCore, ResolvedModel]:
    resolved = resolve_model(config)
    model_cfg = resolved.model_cfg
    device = pick_device(config)
    dtype = pick_dtype(config, model_cfg, device)
    max_model_len = context_length(config, model_cfg)
    torch.manual_seed(config.random_seed)
    model = build_model(model_cfg, resolved.weights_dir, dtype, device, max_model_len, config.random_seed, progress)
    draft = _build_draft_network(config, model_cfg, dtype, device, max_model_len, progress)
    page_size = config.cache.page_size
    per_token = kv_bytes_per_token(model_cfg, dtype) + (_draft_bytes_per_token(draft, dtype) if draft else 0)
    # EAGLE-3 chains and trees run as one program per step (engine/chain_graphs.py, engine/tree_graphs.py).
    # On a CPU, where a read-back costs nothing, trees keep the general search unless asked for (tests).
    use_chain = draft is not None and _is_eagle3(draft) and config.spec.eagle_topk == 1
    use_tree = (draft is not None and _is_eagle3(draft) and config.spec.eagle_topk > 1
                and (device.type == "cuda" or TREE_PROGRAM_ON_CPU))
    max_bs = min(config.cuda_graph_max_bs, config.scheduler.max_running_requests)
    # Tree programs verify their nodes in scratch slots after the pages; their room is not the requests'.
    tree_scratch = max_bs * config.spec.max_drafts if use_tree else 0
    num_pages = plan_num_pages(per_token, config.cache, free_memory_bytes(device) - tree_scratch * per_token)
    use_graphs = device.type == "cuda" and not config.disable_cuda_graph
    if use_graphs:
        from specserve.kernels.pointwise import use_gpu_kernels

        use_gpu_kernels()
    # With CUDA graphs or step programs, one extra page no request owns takes the KV of padded rows.
    pad_page = use_graphs or use_chain or use_tree
    kv_cache = allocate_kv_cache(model_cfg, (num_pages + pad_page) * page_size + tree_scratch, dtype, device)
    proposer, plan, gate, follow, adaptive = None, None, None, None, None
    if draft is not None:
        proposer = _build_proposer(config, draft, model, num_pages * page_size, kv_cache.shape[2], dtype, device)
        plan = _fixed_plan(config.spec.max_drafts)
        if config.spec.adaptive:
            adaptive = AdaptivePlan(config.spec.max_drafts)
            plan, gate, follow = adaptive.num_drafts, adaptive.step_drafts, adaptive.drafting_pays
    scheduler = Scheduler(config.scheduler, PageAllocator(num_pages, page_size), max_model_len, plan,
                          config.spec.max_drafts, gate, follow)
    eos = model_cfg.eos_token_ids + _generation_eos(resolved.weights_dir or resolved.tokenizer_dir)
    runner = ModelRunner(model, kv_cache, device, proposer, config.spec.simulate_accept_len, config.random_seed,
                         config.scheduler.max_running_requests)
    pad_slot = num_pages * page_size
    if use_chain:
        from specserve.speculative.programs.chain import ChainGraphs

        runner.spec_graphs = ChainGraphs(model, proposer.drafter, kv_cache, config.spec.max_drafts, pad_slot, max_bs,
                                         max_model_len, page_size, config.spec.simulate_accept_len,
                                         runner.simulation_rng, capture=use_graphs, progress=progress)
    if use_tree:
        from specserve.speculative.programs.tree import TreeGraphs

        # The head's scratch region starts after its padding slot (see _build_proposer).
        runner.spec_graphs = TreeGraphs(model, proposer.drafter, kv_cache, config.spec.eagle_topk,
                                        config.spec.num_steps, config.spec.max_drafts, pad_slot,
                                        pad_slot + page_size, pad_slot + 1, max_bs, max_model_len, page_size,
                                        config.spec.simulate_accept_len, runner.simulation_rng,
                                        capture=use_graphs, progress=progress)
    if use_graphs:
        from specserve.engine.graphs import DecodeGraphs
        from specserve.kernels.triton import gemv as triton_gemv

        with torch.inference_mode():
            for network in (model, draft):
                if network is not None:
                    triton_gemv.decide_all(network)
        runner.untimed_gemv = triton_gemv.choice.untimed

        # Steps that draft nothing replay the same graphs whether speculation is configured or not; an
        # EAGLE-3 head's taps are stored inside them, so turning drafting on later costs nothing extra.
        runner.graphs = DecodeGraphs(model, kv_cache, num_pages * page_size, max_bs, max_model_len, page_size,
                                     progress, proposer, record_layers, runner.futures)
    if device.type == "cuda":
        _warm_up_decode_kernel(model_cfg, kv_cache, page_size)
        if proposer is not None:
            _warm_up_decode_kernel(_attention_config(draft), proposer.drafter.kv_cache, page_size)
    # On a CPU the "device" is the host itself, so overlapping would only cost the dropped tokens.
    overlap = device.type == "cuda" and not config.disable_overlap
    freeze_startup_objects()
    return EngineCore(scheduler, runner, tuple(dict.fromkeys(eos)), overlap, adaptive), resolved


def freeze_startup_objects() -> None:
    """Moves every object alive now out of the garbage collector's view. The imports and the model's
    construction leave about a million objects that live as long as the process; a full collection walked
    them all, stalling the host ~100 ms eight or nine times in a 25 s serving run at C = 250, while under
    overlap the device waited. Objects made while serving are collected as usual. What an earlier call froze
    is thawed and collected first, so an engine dropped before this one is built (evaluations and benchmarks
    build several in turn) is not kept alive by a reference cycle the collector no longer looks at."""
    thaw_and_collect()
    gc.freeze()


def thaw_and_collect() -> None:
    gc.unfreeze()
    gc.collect()


def _build_draft_network(config: EngineConfig, target_cfg: ModelConfig, dtype, device, max_model_len: int,
                         progress: bool) -> torch.nn.Module | None:
    spec = config.spec
    if spec.algorithm is None:
        return None
    path = None if spec.draft_model_path is None else Path(spec.draft_model_path).expanduser()
    if path is not None and not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in the draft model path {path}")
    if spec.algorithm == "EAGLE3":
        if path is None and config.load_format != "dummy":
            raise ValueError("--speculative-draft-model-path is required for EAGLE3 (a random head needs "
                             "--load-format dummy)")
        # A random head drafts over 32k tokens, the draft vocabulary of public Llama-3 EAGLE-3 heads. Its logits
        # get a spread (std 10) at which its top choice holds ~70 % of the probability, as a trained head's
        # often does; near-uniform drafts would keep EAGLE-2's best nodes within two levels, so a simulated
        # acceptance length could never reach the depths trees are built for. Costs do not change.
        head = load_eagle3_head(path, target_cfg, dtype, device, max_model_len, config.random_seed,
                                draft_vocab_size=None if path else min(32000, target_cfg.vocab_size),
                                logit_std=None if path else RANDOM_HEAD_LOGIT_STD,
                                quantization=spec.draft_model_quantization)
        if head.config.target_hidden_size != target_cfg.hidden_size or head.d2t.max() + head.config.draft_vocab_size > target_cfg.vocab_size:
            raise ValueError("the EAGLE-3 head does not match the target: hidden size or vocabulary differ")
        return head
    draft_cfg = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    if draft_cfg.vocab_size > target_cfg.vocab_size:
        raise ValueError("the draft model's vocabulary is larger than the target's: not the same tokenizer")
    return build_model(draft_cfg, path, dtype, device, max_model_len, config.random_seed, progress)


def _warm_up_decode_kernel(cfg: ModelConfig, kv_cache: torch.Tensor, page_size: int) -> None:
    """Eager calls of the decode kernel (decode rows of steps with prompts, the draft's catch-ups) would
    otherwise compile its forms inside serving steps."""
    if decode_kernel_takes(cfg.head_dim):  # other head dims take the PyTorch path
        from specserve.kernels.triton import attention as triton_attention

        triton_attention.warm_up(cfg.num_heads, kv_cache[0], page_size)


def _attention_config(draft: torch.nn.Module) -> ModelConfig:
    return draft.config.model if _is_eagle3(draft) else draft.config


def _is_eagle3(draft: torch.nn.Module) -> bool:
    return isinstance(draft, Eagle3Head)


def _draft_bytes_per_token(draft: torch.nn.Module, dtype: torch.dtype) -> int:
    if not _is_eagle3(draft):
        return kv_bytes_per_token(draft.config, dtype)
    # One layer of KV, plus the projected target taps kept for catching up.
    hidden = draft.config.model.hidden_size
    return kv_bytes_per_token(draft.config.model, dtype) + hidden * torch.empty((), dtype=dtype).element_size()


def _build_proposer(config: EngineConfig, draft: torch.nn.Module, target: torch.nn.Module, num_slots: int,
                    target_slots: int, dtype, device) -> TreeProposer:
    spec = config.spec
    scratch = config.scheduler.max_running_requests * scratch_slots(spec.eagle_topk, spec.num_steps, spec.max_drafts)
    if _is_eagle3(draft):
        # The slot after the mirrored ones (also the first scratch slot) takes padded rows' KV in graphs.
        kv = allocate_kv_cache(draft.config.model, num_slots + scratch + 1, dtype, device)
        # One row per target KV slot, the graphs' padding slot included.
        taps = torch.zeros(target_slots, draft.config.model.hidden_size, dtype=dtype, device=device)
        drafter = Eagle3Drafter(draft, target.embed_tokens, kv, taps, device)
    else:
        drafter = DraftModelDrafter(draft, allocate_kv_cache(draft.config, num_slots + scratch, dtype, device), device)
    return TreeProposer(drafter, spec.eagle_topk, spec.num_steps, spec.max_drafts, num_slots, device)


def _fixed_plan(num_drafts: int):
    return lambda request: num_drafts


def _generation_eos(model_dir: Path | None) -> tuple[int, ...]:
    path = None if model_dir is None else model_dir / "generation_config.json"
    if path is None or not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
