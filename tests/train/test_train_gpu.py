"""Training on a GPU: datagen through graphs records what eager steps record, and the trainer keeps its
samples on the device."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine_runs import make_prompts, tight_config

pytestmark = pytest.mark.gpu


def test_training_data_recorded_through_graphs_equals_eager_recording(tiny_checkpoint, tmp_path):
    """Datagen on a GPU replays decode graphs that also write the taps and hidden states; the samples
    equal those recorded with graphs off (an fp32 model; the rows are stored in bf16)."""
    from test_train_draft import _assert_same_samples, _recorded_samples

    path = tiny_checkpoint("llama")
    prompts = make_prompts(512, seed=3)
    runs = []
    for disable in (False, True):
        config = replace(tight_config(str(path), 4096), device="cuda", disable_cuda_graph=disable)
        samples, engine = _recorded_samples(config, (0, 1), prompts, tmp_path / str(disable))
        assert disable or engine.runner.graphs.num_replays > 0
        runs.append(samples)
    _assert_same_samples(runs[0], runs[1], 1e-2)


def test_training_on_a_gpu_keeps_samples_on_the_device_and_measures_held_out_agreement(tmp_path):
    """The trainer's GPU path: samples and held-out samples move to the device, bf16 autocast trains, and the
    held-out agreement is measured at each checkpoint."""
    from test_train_draft import _fake_samples, _Target

    from specserve.train.trainer import TrainConfig, Trainer, new_head

    torch.manual_seed(0)
    target = _Target().requires_grad_(False).cuda()
    cfg = TrainConfig(steps=4, batch_size=3, lr=1e-3, warmup_steps=1, ttt_steps=3, checkpoint_every=2)
    trainer = Trainer(new_head(target, torch.arange(40), 256, 0), target, _fake_samples(10, 0), cfg, tmp_path,
                      _fake_samples(4, 1))
    assert trainer.samples[0].taps.is_cuda and trainer.held_out[0].taps.is_cuda and len(trainer.held_out) == 4
    assert trainer.train(progress=False)
    assert [e["step"] for e in trainer.evals] == [2, 4]
    assert all(len(e["accuracy"]) == 3 for e in trainer.evals)
