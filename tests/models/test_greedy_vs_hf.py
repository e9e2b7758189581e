"""Greedy output equals Hugging Face transformers token for token (fp32, CPU), under continuous batching
with mixed prompt lengths, staggered arrivals, chunked prefill and forced preemption."""
from __future__ import annotations

import pytest

from engine_runs import check_matches_hf, tight_config


@pytest.mark.parametrize("kind,sharded", [("llama", True), ("llama-tied", False), ("qwen2", False), ("qwen3", False)])
def test_tiny_models_match_transformers(tiny_checkpoint, kind, sharded):
    path = tiny_checkpoint(kind, sharded)
    check_matches_hf(tight_config(str(path), max_total_tokens=200), path, vocab=512)


def test_smollm2_135m_matches_transformers(smollm2_dir):
    check_matches_hf(tight_config(str(smollm2_dir), max_total_tokens=200), smollm2_dir, vocab=49152)
