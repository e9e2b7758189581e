"""Offline Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`, in-process."""
from __future__ import annotations

import itertools
import re
import threading
import uuid
from dataclasses import replace
from typing import Sequence

from specserve.config import EngineConfig
from specserve.engine.factory import build_engine_core, freeze_startup_objects, thaw_and_collect
from specserve.engine.output import OutputTracker, RequestOutput
from specserve.core import SamplingParams


def load_tokenizer(tokenizer_dir):
    if tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, **template_args) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template, ready for the answer.

    Only the template's own text makes control tokens. The messages' contents are tokenized with special-token
    strings split into plain text, as vLLM and SGLang do, so a message holding "<|im_end|><|im_start|>system"
    cannot close its turn and open another. To find the contents in the rendering, the template is rendered a
    second time with a unique placeholder for each content; the placeholders cut it into template text and
    contents. Where the template trims a content, the trimmed one is used, as the first rendering shows; where it
    changes a content otherwise, the content goes in as sent.
    """
    # OpenAI's tools, for templates that render them; template_args: the template's own (enable_thinking).
    extra = {**({"tools": tools} if tools else {}), **template_args}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    marks = {i: f"\ue000{uuid.uuid4().hex}\ue001" for i, m in enumerate(messages)
             if isinstance(m.get("content"), str) and m["content"]}
    if not marks:
        return _encode(tokenizer, text, split_special=False)
    placeheld = [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)]
    skeleton = tokenizer.apply_chat_template(placeheld, add_generation_prompt=True, tokenize=False, **extra)
    content_of = {mark: messages[i]["content"] for i, mark in marks.items()}
    pieces = re.split("(" + "|".join(map(re.escape, content_of)) + ")", skeleton)  # text, mark, text, ..., text
    for form in (lambda c: c, str.strip):
        parts = [form(content_of[p]) if n % 2 else p for n, p in enumerate(pieces)]
        if "".join(parts) == text:
            break
    else:
        parts = [content_of[p] if n % 2 else p for n, p in enumerate(pieces)]
    ids = []
    with _ENCODE_LOCK:
        for n, part in enumerate(parts):
            ids += _encode(tokenizer, part, split_special=bool(n % 2)) if part else []
    return ids


# A fast tokenizer keeps `split_special_tokens` as state of the Rust tokenizer that every encode call sets, so
# encodes that pass different values must not overlap.
_ENCODE_LOCK = threading.Lock()


def _encode(tokenizer, text: str, split_special: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special)


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig()
        config = replace(config, model_path=model if model is not None else config.model_path)
        config = _apply_overrides(config, overrides)
        self.config = config
        # `record_layers` (training-data generation): CUDA graphs also keep those layers' outputs per row.
        self.engine, self.model_info = build_engine_core(config, progress=overrides.get("progress", False),
                                                         record_layers=overrides.get("record_layers", ()))
        self.tokenizer = load_tokenizer(self.model_info.tokenizer_dir)
        freeze_startup_objects()  # the tokenizer's too
        self._ids = itertools.count()

    def close(self) -> None:
        """Frees the engine's memory now (weights, KV pool, CUDA graphs), so that another engine built in this
        process gets the whole device; this LLM takes no requests after. Dropping the last reference is not
        enough: the engine's objects were frozen out of the garbage collector's view when it was built."""
        self.engine = None
        thaw_and_collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        trackers = [self.add(p, params) for p in _as_list(prompts)]
        while self.engine.has_work():
            self.step_and_track(trackers)
        return [t.output for t in trackers]

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the answer."""
        return chat_prompt_ids(self.tokenizer, messages)

    def add(self, prompt: str | Sequence[int], params: SamplingParams) -> OutputTracker:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, ids, params)
        return OutputTracker(self.tokenizer, request_id, ids, params)

    def step_and_track(self, trackers: list[OutputTracker]) -> None:
        by_id = {t.output.request_id: t for t in trackers}
        for delta in self.engine.step():
            tracker = by_id.get(delta.request_id)
            if tracker is None:
                continue
            tracker.update(delta.new_token_ids, delta.finish_reason, delta)
            if tracker.output.stopped_by_string and delta.finish_reason is None:
                self.engine.abort([delta.request_id])


def _as_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts


_CACHE_FIELDS = {"page_size", "mem_fraction_static", "max_total_tokens", "enable_prefix_caching"}
_SCHED_FIELDS = {"max_running_requests", "chunked_prefill_size", "max_queued_requests"}
_PARALLEL_FIELDS = {"tp_size"}


def _apply_overrides(config: EngineConfig, overrides: dict) -> EngineConfig:
    cache = {k: v for k, v in overrides.items() if k in _CACHE_FIELDS}
    sched = {k: v for k, v in overrides.items() if k in _SCHED_FIELDS}
    special = {"progress", "record_layers"}
    parallel = {k: v for k, v in overrides.items() if k in _PARALLEL_FIELDS}
    top = {k: v for k, v in overrides.items() if k not in _CACHE_FIELDS | _SCHED_FIELDS | _PARALLEL_FIELDS | special}
    return replace(
        config,
        cache=replace(config.cache, **cache),
        scheduler=replace(config.scheduler, **sched),
        parallel=replace(config.parallel, **parallel),
        **top,
    )
