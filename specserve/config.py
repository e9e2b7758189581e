"""Frozen configuration, layered by who reads it: model < cache/scheduler < engine < server.

Constructors here never touch files or devices; `from_hf_config` takes an already-parsed dict.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style frequency scaling ('llama3'), plain position interpolation ('linear'), or YaRN ('yarn',
    as DeepSeek-V3 and Kimi-K2 configs use it: `beta_*` bound the blended band, `mscale*` scale the angles'
    cos/sin and, in MLA, the softmax)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # YaRN's cos/sin scale; None: from factor and the mscales
    truncate: bool = True


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values come from a per-token latent of
    `kv_lora_rank` values plus one shared rotary key of `qk_rope_head_dim`, which is all the KV cache keeps."""

    q_lora_rank: int | None  # None: queries straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs stored interleaved (x0, x1), (x2, x3) as DeepSeek's weights are

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (plus shared experts that every token passes through) in the layers `sparse_layers`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert; a shared block is `num_shared_experts` times as wide
    sparse_layers: tuple[int, ...]
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"  # or "sigmoid", with a per-expert score correction bias (DeepSeek-V3)
    num_shared_experts: int = 0
    n_group: int = 1  # grouped top-k: experts come from the `topk_group` groups with the best scores
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only transformer, as the model code needs it. Which architectures are
    supported, and what sets each apart, is models/registry.py's and the model files' to say."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # as the HF config says; which projections it covers is the model's
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None

    @property
    def kv_entry_shape(self) -> tuple[int, int, int]:
        """What one token's KV occupies in one layer of the pool: (planes, heads, dim). Dense attention keeps
        keys and values, (2, kv heads, head dim); MLA keeps its latent and rotary key, (1, 1, latent dim)."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, self.num_kv_heads, self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        num_heads = cfg["num_attention_heads"]
        mla = _mla(cfg)
        # MLA's values are its heads' outputs: a draft head shaped like one of its layers takes their width.
        head_dim = mla.v_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            mla=mla,
            moe=_deepseek_moe(cfg) or _qwen_moe(cfg),
        )


def _mla(cfg: dict[str, Any]) -> MLAConfig | None:
    if cfg.get("kv_lora_rank") is None:
        return None
    return MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                     qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                     v_head_dim=cfg["v_head_dim"], rope_interleave=cfg.get("rope_interleave", True))


def _deepseek_moe(cfg: dict[str, Any]) -> MoEConfig | None:
    """DeepSeek-V3's experts: layers from `first_k_dense_replace` on, every `moe_layer_freq`-th, are MoE."""
    if not cfg.get("n_routed_experts"):
        return None
    first, every = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
    return MoEConfig(
        num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        sparse_layers=tuple(i for i in range(cfg["num_hidden_layers"]) if i >= first and i % every == 0),
        # Sigmoid scores whatever `scoring_func` says, as transformers' DeepseekV3 router has them.
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), scoring_func="sigmoid",
        num_shared_experts=cfg.get("n_shared_experts") or 0, n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1, routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))


def _qwen_moe(cfg: dict[str, Any]) -> MoEConfig | None:
    """Qwen-MoE's experts: layer i is MoE where (i + 1) % `decoder_sparse_step` == 0, unless `mlp_only_layers`
    lists it. transformers 5 writes `num_experts` as `num_local_experts`."""
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not num_experts:
        return None
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    return MoEConfig(
        num_experts=num_experts, top_k=cfg["num_experts_per_tok"], intermediate_size=cfg["moe_intermediate_size"],
        sparse_layers=tuple(i for i in range(cfg["num_hidden_layers"]) if (i + 1) % step == 0 and i not in dense),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), scoring_func="softmax")


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 moved rope settings into `rope_parameters`; older configs use `rope_scaling`.
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rope_theta") or _rope_params(cfg).get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    params = _rope_params(cfg)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type not in ("llama3", "linear", "yarn"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    original = int(params.get("original_max_position_embeddings", 8192))
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":  # as transformers: the ratio of the two context lengths
        factor = cfg.get("max_position_embeddings", original) / original
    return RopeScaling(
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    # Fraction of free device memory (after weights) that the KV pool may take.
    mem_fraction_static: float = 0.85
    # Hard cap on pooled KV tokens; None means "size from memory".
    max_total_tokens: int | None = None
    # Share full pages of computed prefixes between requests (kv/prefix.py), draft KV and taps included.
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 256
    # Tokens computed per engine step, summed over requests; long prompts are chunked to fit.
    chunked_prefill_size: int = 2048
    max_queued_requests: int = 1024


SPEC_POLICIES = ("on-off", "goodput", "sglang-tiers")
SGLANG_TIER_STEPS = (1, 3, 5, 7)  # the draft steps SGLang's tiers may pick (speculative/tiers.py)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding; flag names and meanings follow SGLang's (--speculative-*).

    `num_draft_tokens` counts the tokens one request verifies per step, the root included, so a step drafts
    up to num_draft_tokens - 1 tokens. With topk = 1 (a chain) it is num_steps + 1.
    """

    algorithm: str | None = None  # None, or a name in speculative/registry.py: "EAGLE3", "DRAFT_MODEL"
    # EAGLE3: a head in the public EAGLE-3 format (None: random, only with --load-format dummy).
    # DRAFT_MODEL: a smaller causal LM with the target's tokenizer.
    draft_model_path: str | None = None
    num_steps: int = 3  # levels of the draft tree (chain depth when topk = 1)
    eagle_topk: int = 1  # children expanded per node; 1 drafts a chain
    num_draft_tokens: int | None = None  # None: num_steps * topk + 1
    # Speed studies only: accept a drawn number of drafts with mean acceptance length tau (speculative/simulate.py).
    simulate_accept_len: float | None = None
    # Draft only in steps, and for requests, where it pays by measured cost and acceptance (speculative/plan.py);
    # off, every decode step drafts whenever no prompt is pending.
    adaptive: bool = False
    # "fp8": the EAGLE-3 head's projections in fp8 (weight-only, a scale per output feature), as SGLang's
    # --speculative-draft-model-quantization: half the bytes a draft step of at most 16 rows reads (larger calls
    # widen the weights first). Output stays the target's (every token is verified); what it may cost is
    # acceptance (docs/speculative.md).
    draft_model_quantization: str | None = None
    # What the adaptive plan chooses (docs/speculative.md): "on-off" drafts the configured shape or nothing;
    # "goodput" also picks shorter chains per step and request; "sglang-tiers" is SGLang's policy, a baseline.
    policy: str = "on-off"

    def __post_init__(self) -> None:
        if self.simulate_accept_len is not None and (self.algorithm is None or self.simulate_accept_len < 1):
            raise ValueError("--speculative-simulate-accept-len needs a speculative algorithm and a value >= 1")
        if self.draft_model_quantization not in (None, "fp8"):
            raise ValueError(f"unsupported draft model quantization {self.draft_model_quantization!r} (fp8 or none)")
        if self.draft_model_quantization and self.algorithm != "EAGLE3":
            raise ValueError("--speculative-draft-model-quantization applies to an EAGLE3 head")
        if self.algorithm == "DRAFT_MODEL" and not self.draft_model_path:
            raise ValueError("--speculative-draft-model-path is required with DRAFT_MODEL")
        if self.policy not in SPEC_POLICIES:
            raise ValueError(f"--speculative-policy must be one of {', '.join(SPEC_POLICIES)}, got {self.policy!r}")
        if self.num_steps < 1 or self.eagle_topk < 1:
            raise ValueError("--speculative-num-steps and --speculative-eagle-topk must be at least 1")
        if self.num_draft_tokens is None or self.eagle_topk == 1:
            # A chain verifies exactly its drafts plus the root, as in SGLang.
            object.__setattr__(self, "num_draft_tokens", self.num_steps * self.eagle_topk + 1)
        most = self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
        if not 2 <= self.num_draft_tokens <= most + 1:
            raise ValueError(f"--speculative-num-draft-tokens must be in [2, {most + 1}] for "
                             f"{self.num_steps} steps of top-{self.eagle_topk}")

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1

    @property
    def chain_lengths(self) -> tuple[int, ...]:
        """The chain lengths a step may take besides a tree: the configured chain alone, unless the policy picks
        shorter ones (a tree server's chains go as deep as its steps, and are shorter than the tree)."""
        depth = self.num_steps
        if not self.adaptive or self.policy == "on-off":
            return (depth,) if self.eagle_topk == 1 else ()
        if self.policy == "goodput":
            return tuple(range(1, depth + 1))
        lengths = {min(s, depth) for s in SGLANG_TIER_STEPS}
        return tuple(sorted(lengths if self.eagle_topk == 1 else lengths - {depth}))

    @property
    def tree_sizes(self) -> tuple[tuple[int, int], ...]:
        """(drafts, search levels) of each tree a step may take, largest (the configured tree) first; none on a
        chain server. Under the goodput policy, smaller trees too: each halves the last one's token budget and
        levels. The budget sets the verify's rows and the levels its draft passes, so each size roughly halves
        what a step adds to a plain one, and best-first selection keeps a small budget near the root anyway.
        Top-k stays: k children per node cost one fed row each, and let a small budget take the likeliest
        nodes wherever they are. A size stops the ladder once it has no more drafts than the deepest chain (a
        tree of d drafts verifies what a chain of d does; the plan's pruning shrinks a request's tree
        further), and at most three sizes are kept, each a program to capture on a GPU."""
        if self.eagle_topk == 1:
            return ()
        sizes = [(self.max_drafts, self.num_steps)]
        if not self.adaptive or self.policy != "goodput":
            return tuple(sizes)
        tokens, levels = self.num_draft_tokens, self.num_steps
        while len(sizes) < 3:
            tokens, levels = tokens // 2, -(-levels // 2)
            most = self.eagle_topk + (levels - 1) * self.eagle_topk**2
            drafts = min(tokens - 1, most)
            if drafts <= max(self.chain_lengths, default=0):
                break
            sizes.append((drafts, levels))
            tokens = drafts + 1  # a level's top-k may cap the budget: the next size halves what this one verifies
        return tuple(sizes)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (docs/parallel.md): the target (and the EAGLE-3 head, replicated) on `tp_size` ranks,
    one process and one device each; the engine process is rank 0."""

    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be at least 1, got {self.tp_size}")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    tokenizer_path: str | None = None  # None: the model's own directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    context_length: int | None = None
    random_seed: int = 0
    cache_dir: str | None = None  # where converted GGUF checkpoints are kept
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    # Overlap scheduling (on a GPU; chain and tree program steps too, the general draft search not): prepare step
    # N+1 while step N runs.
    disable_overlap: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    shutdown_timeout: float = 30.0  # seconds a SIGTERM/SIGINT lets requests in flight finish (vLLM's name)
    # What one client can make the front-end hold (server/limits.py): a body's bytes, and the seconds a request's
    # headers, then its body, may take to arrive.
    max_request_body_bytes: int = 4 * 1024 * 1024
    request_read_timeout: float = 30.0


ROUTER_POLICIES = ("cache_aware", "power_of_two", "least_load", "round_robin", "random")


@dataclass(frozen=True)
class ScaleOutConfig:
    """`specserve serve --dp-size N`: N replica servers behind the smg gateway (server/replicas.py)."""

    dp_size: int = 1
    router_policy: str = "cache_aware"  # smg's --policy: prefix-cache affinity, balanced by load

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be at least 1, got {self.dp_size}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}")
