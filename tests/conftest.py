"""Fixtures shared by the tests (their helpers are modules beside this file: kernel_checks, engine_runs,
tiny_checkpoints, ...), and the skip of tests marked `gpu` on machines without CUDA."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from tiny_checkpoints import TINY_BASE, write_tiny_checkpoint


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(needs_cuda)


@pytest.fixture
def switches():
    """Sets environment switches (specserve/envs.py) for the rest of the test: `switches(fused_topk=False)`."""
    from specserve import envs

    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(envs.override(**values))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    made = {}

    def get(kind: str, sharded: bool = False):
        key = (kind, sharded)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            write_tiny_checkpoint(kind, path, sharded)
            made[key] = path
        return made[key]

    return get


@pytest.fixture(scope="session")
def random_eagle3_head(tiny_checkpoint, tmp_path_factory):
    """A random EAGLE-3 head for the sharded tiny Llama (almost nothing it drafts is accepted)."""
    import torch

    from specserve.models.loader import load_eagle3_head, read_model_config, save_eagle3_head

    head_dir = tmp_path_factory.mktemp("eagle3-random")
    target = read_model_config(tiny_checkpoint("llama", True))
    save_eagle3_head(load_eagle3_head(None, target, torch.float32, torch.device("cpu"), 512, seed=7), head_dir)
    return head_dir


@pytest.fixture(scope="session")
def noisy_draft_model(tiny_checkpoint, tmp_path_factory):
    """A draft model that is the sharded tiny Llama with noise on its weights: some drafts accepted, some not."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("draft-noisy")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama", True), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct, converted from its GGUF once per test session."""
    from specserve.models.gguf import cached_conversion, find_embedded_gguf

    return cached_conversion(find_embedded_gguf(), tmp_path_factory.getbasetemp() / "specserve-cache")


@pytest.fixture(scope="session")
def chat_tokenizer_dir(request):
    """SmolLM2's tokenizer files: from the embedded model, or from the folder TOKENIZER_DIR names (a copy of
    its tokenizer.json, tokenizer_config.json and chat_template.jinja, for a machine without the GGUF)."""
    if os.environ.get("TOKENIZER_DIR"):
        return Path(os.environ["TOKENIZER_DIR"])
    return request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, chat_tokenizer_dir):
    """A tiny random Llama that shares SmolLM2's vocabulary, tokenizer and chat template: fast to run,
    real text in and out."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-chat")
    settings = {**TINY_BASE, "vocab_size": 49152, "eos_token_id": 2, "tie_word_embeddings": True,
                "max_position_embeddings": 1024}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **settings), dtype=torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (chat_tokenizer_dir / name).exists():
            shutil.copy(chat_tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_chat_head(tiny_chat_model, tmp_path_factory):
    """A random EAGLE-3 head for the tiny chat model, sharp enough that its drafts differ per prompt."""
    from specserve.models.loader import load_eagle3_head, read_model_config, save_eagle3_head

    path = tmp_path_factory.mktemp("tiny-chat-eagle3")
    head = load_eagle3_head(None, read_model_config(tiny_chat_model), torch.float32, torch.device("cpu"), 1024,
                            seed=3, draft_vocab_size=16000, logit_std=10.0)
    save_eagle3_head(head, path)
    return path
