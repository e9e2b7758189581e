"""`--tokenizer-path`: a model directory without a tokenizer (a shipped config run with dummy weights) takes
one from elsewhere, so prompts are text and constraints compile."""
from __future__ import annotations

import re
import shutil
from dataclasses import replace

import pytest

from engine_runs import tight_config
from specserve.core import Constraint, SamplingParams
from specserve.llm import LLM


def test_a_dummy_model_takes_its_tokenizer_from_the_path(tiny_chat_model, tmp_path):
    shutil.copy(tiny_chat_model / "config.json", tmp_path / "config.json")
    config = replace(tight_config(str(tmp_path), max_total_tokens=256), load_format="dummy")
    assert LLM(config=config).tokenizer is None

    llm = LLM(config=replace(config, tokenizer_path=str(tiny_chat_model)))
    prompt = llm.chat_prompt([{"role": "user", "content": "A date?"}])
    params = SamplingParams(max_tokens=16, temperature=0.0, constraint=Constraint("regex", r"20[0-9]{2}-[01][0-9]"))
    (output,) = llm.generate([prompt], params)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", output.text)


def test_a_tokenizer_path_without_a_tokenizer_is_refused(tiny_chat_model, tmp_path):
    config = replace(tight_config(str(tiny_chat_model), max_total_tokens=256), tokenizer_path=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tokenizer-path"):
        LLM(config=config)
