"""`--speculative-draft-model-path` takes a GGUF file, as `--model` does: it is converted once into the same
cache as a GGUF target."""
from __future__ import annotations

import torch

from specserve.config import EngineConfig, SpecConfig
from specserve.models.gguf import find_embedded_gguf
from specserve.models.loader import read_model_config
from specserve.speculative.drafters.draft_model import DraftModel


def test_a_gguf_file_is_accepted_as_the_draft_model(smollm2_dir, tmp_path_factory):
    # smollm2_dir converted the embedded GGUF into this cache already, so the load below only reads it.
    cache = tmp_path_factory.getbasetemp() / "specserve-cache"
    gguf = find_embedded_gguf()
    config = EngineConfig(model_path=str(smollm2_dir), cache_dir=str(cache),
                          spec=SpecConfig("DRAFT_MODEL", str(gguf)))
    target_cfg = read_model_config(smollm2_dir)
    draft = DraftModel().load(config, target_cfg, torch.float32, torch.device("cpu"), 256, progress=False)
    assert draft.config.vocab_size == target_cfg.vocab_size
    assert draft.config == target_cfg
