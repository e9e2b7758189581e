"""EAGLE-3 heads shipped with specserve, in the public format (config.json + bf16 safetensors shards).

`smollm2_135m_instruct` drafts for the embedded default model. It was trained with
`benchmarks/train_smollm2_h200.sh` (specserve train-draft on one GPU); docs/training.md ("The bundled head")
records its data, time and acceptance.
"""
from __future__ import annotations

from pathlib import Path

SMOLLM2_HEAD = Path(__file__).parent / "smollm2_135m_instruct"

# The draft shape the default server uses with it: on a small CPU at batch 1 the 5-step chain was a little
# faster than the 3-step one; longer chains cost little there, since verifying 6 tokens streams the same
# weights as verifying 4.
SMOLLM2_DEFAULT_STEPS = 5
SMOLLM2_DEFAULT_TOPK = 1
