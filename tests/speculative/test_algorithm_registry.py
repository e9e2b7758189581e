"""The registry is the one list of speculative algorithms: the CLI offers its names, the engine builds from it,
and a name it does not hold is refused before any weights load."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specserve.cli import build_parser
from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.speculative import registry
from specserve.speculative.base import Algorithm

from engine_runs import tight_config


def test_every_entry_meets_the_algorithm_protocol():
    for name, entry in registry.ALGORITHMS.items():
        for member in ("load", "bytes_per_token", "target_scratch_slots", "needs_pad_page", "build"):
            assert callable(getattr(entry, member, None)), f"{name} lacks {member} of {Algorithm.__name__}"


def test_the_cli_offers_exactly_the_registered_algorithms():
    parser = build_parser()
    for name in registry.ALGORITHMS:
        assert parser.parse_args(["serve", "--speculative-algorithm", name]).speculative_algorithm == name
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-algorithm", "NGRAM"])


def test_an_unregistered_algorithm_is_refused_before_the_target_loads(tiny_checkpoint, monkeypatch):
    from specserve.engine import factory

    def no_model(*args, **kwargs):
        raise AssertionError("the target was built before the algorithm was looked up")

    monkeypatch.setattr(factory, "build_model", no_model)
    config = replace(tight_config(str(tiny_checkpoint("llama", False)), 200), spec=SpecConfig("NGRAM"))
    with pytest.raises(ValueError, match="unsupported speculative algorithm 'NGRAM'; supported: "):
        build_engine_core(config, progress=False)


def test_a_new_algorithm_is_one_registry_line(tiny_checkpoint, monkeypatch):
    """An entry registered under a new name is what the engine builds for that name."""
    built = []

    class Recording(type(registry.ALGORITHMS["EAGLE3"])):
        def build(self, *args, **kwargs):
            built.append(True)
            return super().build(*args, **kwargs)

    monkeypatch.setitem(registry.ALGORITHMS, "EAGLE3_COPY", Recording())
    path = tiny_checkpoint("llama", False)
    config = replace(tight_config(str(path), 200), load_format="dummy", spec=SpecConfig("EAGLE3_COPY"))
    engine, _ = build_engine_core(config, progress=False)
    assert built and engine.runner.proposer is not None
