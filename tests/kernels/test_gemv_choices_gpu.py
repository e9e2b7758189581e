"""The GEMV chooser on a GPU: decisions made at startup and never timed inside a serving step; shipped and
saved decisions taken without timing."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.config import SpecConfig
from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core

from engine_runs import tight_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("in_weights", [False, True], ids=["norm-weights-apart", "norm-weights-in-projections"])
def test_serving_steps_never_time_gemv_shapes(tiny_checkpoint, monkeypatch, switches, in_weights):
    """With CUDA graphs the GEMV choices are made at startup, the eager draft model's included; a shape still
    undecided when a step runs takes cuBLAS (timing it clones the weight, captures a graph and synchronises
    mid-step). Outside steps it is timed as before. With the norm weights moved into the projections
    (SPECSERVE_NORM_IN_WEIGHTS), startup decides the forms without the norm's weight in the kernel."""
    from specserve import envs
    from specserve.kernels.tuning import chooser
    from specserve.layers.linear import Linear

    switches(norm_in_weights=in_weights)
    path = tiny_checkpoint("llama", True)
    spec = SpecConfig("DRAFT_MODEL", str(path), 3)
    config = replace(tight_config(str(path), max_total_tokens=400), device="cuda", dtype="bfloat16", spec=spec)
    engine, _ = build_engine_core(config, progress=False)
    draft = engine.runner.proposer.drafter.model
    assert draft.layers[0].mlp.gate_up_proj.norm_in_weight == in_weights
    for name, linear in draft.named_modules():
        if isinstance(linear, Linear):
            x = torch.zeros(16, linear.in_features, device="cuda", dtype=torch.bfloat16)
            for rows in chooser.ROW_BUCKETS:
                for norm in (False, True) if linear.takes_norm and envs.get().fold_norms else (False,):
                    key = chooser.choice.key(x[:rows], linear.weight, linear.gated, norm,
                                             gamma=not linear.norm_in_weight)
                    assert key in chooser.choice.best, name
    timed = []
    monkeypatch.setattr(chooser.choice, "best", {})  # every shape undecided again
    monkeypatch.setattr(chooser.Choice, "_measure", lambda self, key, *args: timed.append(key))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((3, 40, 9)):
        engine.add_request(str(i), list(range(10, 10 + n)), params)
    produced = {}
    while engine.has_work():
        for delta in engine.step():
            produced.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert len(produced) == 3 and all(len(tokens) == 6 for tokens in produced.values()) and timed == []
    weight = engine.runner.model.layers[0].mlp.down_proj.weight
    chooser.choice.tile(torch.randn(2, weight.shape[1], device="cuda", dtype=weight.dtype), weight)
    assert len(timed) == 1


def test_gemv_decisions_shipped_for_this_gpu_are_taken_without_timing(switches):
    """Unless SPECSERVE_GEMV_CHOICES says otherwise, a GPU with decisions shipped in the package takes them
    (on an H200: the 8B chain verify's 4-row ones), and a GPU without any times the shape. A switch the
    decisions depend on, off its default (here the fp8 widening), sets them aside, and so does
    SPECSERVE_GEMV_CHOICES=0."""
    from specserve import envs
    from specserve.kernels.tuning import choices as gemv_choices
    from specserve.kernels.tuning import chooser

    assert envs.Switches().gemv_choices == "shipped"  # the default
    name = torch.cuda.get_device_name()
    shipped = gemv_choices.shipped(name)
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")  # an 8B attention output
    x = torch.randn(4, 4096, dtype=torch.bfloat16, device="cuda")
    choice = chooser.Choice("shipped")
    tile = choice.tile(x, weight)
    key = choice.key(x, weight)
    if shipped is None or not choice.at_defaults():  # an A/B switch set off its default
        assert key in choice.timings and choice.saved is None
    else:
        assert key not in choice.timings and tile == gemv_choices.load(shipped, name)[key]
        assert choice.saved == f"shipped: {shipped.name}"
    for saved in ("0", "none", "OFF", ""):
        choice = chooser.Choice(saved)
        choice.tile(x, weight)
        assert key in choice.timings and choice.saved is None, saved
    switches(gemv_fp8_bits=False)
    choice = chooser.Choice("shipped")
    choice.tile(x, weight)
    assert key in choice.timings and choice.saved is None


def test_gemv_decisions_from_a_file_are_taken_without_timing(tmp_path):
    """SPECSERVE_GEMV_CHOICES: a decision saved for this GPU is used as saved and not timed; a shape the file
    lacks is timed as usual."""
    from specserve.kernels.tuning import choices as gemv_choices
    from specserve.kernels.tuning import chooser

    weight = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    key = chooser.Choice.key(x, weight)
    odd_tile = chooser.ROWS_TILES[0]  # whatever timing would say
    path = tmp_path / "choices.json"
    gemv_choices.save({key: odd_tile}, path, torch.cuda.get_device_name())
    choice = chooser.Choice(str(path))
    assert choice.tile(x, weight) == odd_tile and key not in choice.timings
    other_weight = torch.randn(128, 512, dtype=torch.bfloat16, device="cuda")
    choice.tile(x, other_weight)
    assert choice.key(x, other_weight) in choice.timings
