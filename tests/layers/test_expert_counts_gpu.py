"""Expert counts on a GPU: steps replayed from CUDA graphs (plain decode graphs, the chain program), overlapped,
count what eager steps count, each to its own kind of step."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specserve.config import SpecConfig
from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core

from engine_runs import make_prompts, tight_config
from tiny_checkpoints import write_peaked_random_head
from test_expert_counts import _counting_engine

pytestmark = pytest.mark.gpu


def _decode_counts(config) -> tuple[dict, object]:
    """Four requests decoding together (a captured batch size: no padded rows), to the end."""
    engine, counts = _counting_engine(config)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(512, seed=3)[:4]):
        engine.add_request(str(i), prompt, params)
    while engine.has_work():
        engine.step()
    return counts.summary(engine.runner.model), engine


@pytest.mark.parametrize("shape", ["plain", "chain"])
def test_graphed_steps_count_what_eager_steps_count(shape, tiny_checkpoint, tmp_path):
    path = str(tiny_checkpoint("qwen3-moe"))
    config = replace(tight_config(path, 1024), device="cuda")
    config = replace(config, scheduler=replace(config.scheduler, chunked_prefill_size=256))
    if shape == "chain":  # the chain program's graphs, a random EAGLE-3 head drafting
        write_peaked_random_head(path, tmp_path)
        config = replace(config, spec=SpecConfig("EAGLE3", str(tmp_path), 3))
    graphed, engine = _decode_counts(config)
    assert engine.runner.graphs is not None and engine.overlap
    assert shape == "plain" or engine.runner.program.num_runs > 3
    eager, _ = _decode_counts(replace(config, disable_cuda_graph=True, disable_overlap=True))
    kind = "decode" if shape == "plain" else "drafting"
    assert graphed[kind]["mean_distinct_experts_per_layer"] == eager[kind]["mean_distinct_experts_per_layer"]
    assert graphed[kind]["steps"] > 3
