"""`--speculative-algorithm` name -> how that algorithm is built. A new drafter is one file under drafters/
with a class like `drafters.eagle3.Eagle3`, plus one line here.

Each entry meets the `Algorithm` protocol of speculative/base.py.
"""
from __future__ import annotations

from specserve.speculative.base import Algorithm
from specserve.speculative.drafters.draft_model import DraftModel
from specserve.speculative.drafters.eagle3 import Eagle3

ALGORITHMS: dict[str, Algorithm] = {
    "EAGLE3": Eagle3(),
    "DRAFT_MODEL": DraftModel(),
}


def algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unsupported speculative algorithm {name!r}; supported: {sorted(ALGORITHMS)}") from None
