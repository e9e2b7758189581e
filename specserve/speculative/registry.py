"""`--speculative-algorithm` name -> how that algorithm is built. A new drafter is one file under drafters/
with a class like `drafters.eagle3.Eagle3`, plus one line here.

Each entry is built in the factory's order (engine/factory.py): `load` the draft network; `bytes_per_token`
(what it keeps per target KV slot) and `target_scratch_slots` size the KV pool, and `needs_pad_page` whether it
needs a page no request owns; then `build` makes the `Speculator` (speculative/base.py) on the allocated pool.
"""
from __future__ import annotations

from specserve.speculative.drafters.draft_model import DraftModel
from specserve.speculative.drafters.eagle3 import Eagle3

ALGORITHMS = {
    "EAGLE3": Eagle3(),
    "DRAFT_MODEL": DraftModel(),
}


def algorithm(name: str):
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unsupported speculative algorithm {name!r}; supported: {sorted(ALGORITHMS)}") from None
