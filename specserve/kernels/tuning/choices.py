"""GEMV tiles, and the chooser's decisions as a file that a later start can take instead of timing them.

The chooser (tuning/chooser.py) decides each weight shape's tile by timing it alone in a CUDA graph. A
decision made another way, such as by the verify step's own time (benchmarks/gemv_decisions.py), or simply one
a start already paid for, can be saved with `save` and given to a server with SPECSERVE_GEMV_CHOICES=FILE.
Decisions hold for the GPU they were made on, so a file names its GPU and `load` refuses another's. A decision
is keyed by weight shape, dtype, row bucket and call form only: it holds for every call of that bucket (a 4-row
decision made for the chain's verify also serves plain decode at 3 or 4 rows), and it was made under the
chooser's settings of the run that saved it (candidate tiles, cuBLAS margin, the norm and fp8 switches), which
the file does not record. This module needs no Triton, so its file format is tested on any machine.

Decisions measured here for a GPU ship with the package (`decisions/`, one file per GPU name), the way
SGLang and vLLM ship tuned kernel configs per device: a server on that GPU takes them unless told otherwise.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap: bool = False  # several rows: the weight tile is the dot's left operand (see triton/gemv._product)
    tma: bool = False  # with swap: the weight tiles come by TMA (see triton/gemv._gemv_tma_kernel)
    split_k: int = 1  # several rows: programs per output tile, each over a slice of K (see chooser.SPLIT_ROWS_TILES)


SHIPPED_DIR = Path(__file__).parent / "decisions"


def shipped(device: str) -> Path | None:
    """The decisions file shipped for the GPU named `device`, if there is one."""
    path = SHIPPED_DIR / f"{re.sub(r'[^A-Za-z0-9]+', '_', device).strip('_')}.json"
    return path if path.is_file() else None


# A decision's key: (weight shape, dtype, row bucket, gate/up form, norm folded, the norm's weight in the kernel).
Key = tuple[tuple[int, ...], torch.dtype, int, bool, bool, bool]


def save(decisions: dict[Key, Tile | None], path: str | Path, device: str) -> None:
    """Writes `decisions` (None: cuBLAS) as JSON, with the name of the GPU they were made on."""
    entries = [{"weight": list(shape), "dtype": str(dtype).removeprefix("torch."), "rows": rows, "gate_up": gate_up,
                "norm": norm, "gamma_in_kernel": gamma, "tile": None if tile is None else asdict(tile)}
               for (shape, dtype, rows, gate_up, norm, gamma), tile in decisions.items()]
    Path(path).write_text(json.dumps({"device": device, "decisions": entries}, indent=1))


def load(path: str | Path, device: str) -> dict[Key, Tile | None]:
    """The decisions `save` wrote; a ValueError if they were made on another GPU than `device`."""
    record = json.loads(Path(path).read_text())
    if record.get("device") != device:
        raise ValueError(f"{path} holds GEMV decisions made on {record.get('device')!r}, not on this {device!r}")
    decisions = {}
    for e in record.get("decisions", []):
        try:
            dtype = getattr(torch, e["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{e['dtype']!r} is not a torch dtype")
            key = (tuple(e["weight"]), dtype, e["rows"], e["gate_up"], e["norm"], e["gamma_in_kernel"])
            decisions[key] = None if e["tile"] is None else Tile(**e["tile"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: malformed decision {e!r}: {err}") from err
    return decisions
