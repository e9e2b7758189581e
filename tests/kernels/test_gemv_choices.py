"""The GEMV chooser's decisions file (kernels/tuning/choices.py): what a start saves, a later one reads back whole,
and only on the GPU it was made on."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.kernels.tuning import choices as gemv_choices
from specserve.kernels.tuning.choices import Tile

DECISIONS = {
    ((4096, 4096), torch.bfloat16, 4, False, False, False): Tile(64, 128, 4, 6, swap=True),
    ((28672, 4096), torch.bfloat16, 4, True, True, False): Tile(128, 64, 4, 5, swap=True),
    ((6144, 4096), torch.float16, 16, False, True, True): None,  # cuBLAS
    ((4096, 14336), torch.bfloat16, 1, False, False, False): Tile(4, 512, 8, 4),
    ((4096, 14336), torch.float8_e4m3fn, 4, False, False, False): Tile(32, 256, 4, 4, split_k=4),
}


def test_decisions_saved_before_tiles_could_split_read_as_unsplit(tmp_path):
    path = tmp_path / "choices.json"
    gemv_choices.save(DECISIONS, path, "NVIDIA H200")
    record = json.loads(path.read_text())
    for entry in record["decisions"]:
        if entry["tile"] is not None:
            entry["tile"].pop("split_k")
    path.write_text(json.dumps(record))
    assert {tile.split_k for tile in gemv_choices.load(path, "NVIDIA H200").values() if tile} == {1}


def test_decisions_survive_a_round_trip(tmp_path):
    path = tmp_path / "choices.json"
    gemv_choices.save(DECISIONS, path, "NVIDIA H200")
    assert gemv_choices.load(path, "NVIDIA H200") == DECISIONS


def test_decisions_made_on_another_gpu_or_malformed_are_refused(tmp_path):
    path = tmp_path / "choices.json"
    gemv_choices.save(DECISIONS, path, "NVIDIA H200")
    with pytest.raises(ValueError, match="NVIDIA H200"):
        gemv_choices.load(path, "NVIDIA A100-SXM4-80GB")
    record = json.loads(path.read_text())
    record["decisions"][0]["dtype"] = "manual_seed"  # a torch attribute, not a dtype
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="not a torch dtype"):
        gemv_choices.load(path, "NVIDIA H200")
    del record["decisions"][0]["dtype"], record["decisions"][1]["rows"]
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="malformed"):
        gemv_choices.load(path, "NVIDIA H200")


def test_shipped_decisions_are_found_by_gpu_name_and_load_there_only():
    """The package's decisions for the H200 (what a server there takes unless SPECSERVE_GEMV_CHOICES says
    otherwise) load whole on that GPU; a GPU with no file gets none."""
    path = gemv_choices.shipped("NVIDIA H200")
    assert path is not None and path.name == "NVIDIA_H200.json"
    decisions = gemv_choices.load(path, "NVIDIA H200")
    # The chain verify's row bucket of the 16-bit weights; every bucket of an fp8 EAGLE-3 head's.
    assert decisions and {key[2] for key in decisions if key[1] == torch.bfloat16} == {4}
    assert {key[2] for key in decisions if key[1] == torch.float8_e4m3fn} == {1, 2, 4, 8, 16}
    assert all(tile is None or isinstance(tile, Tile) for tile in decisions.values())
    assert gemv_choices.shipped("NVIDIA GeForce RTX 4090") is None
    with pytest.raises(ValueError, match="NVIDIA H200"):
        gemv_choices.load(path, "NVIDIA H100 80GB HBM3")
