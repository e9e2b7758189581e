"""The environment switches (specserve/envs.py): each documented for users, parsed strictly, overridable in
tests, and read nowhere else."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from specserve import envs

ROOT = Path(__file__).resolve().parents[1]


def test_every_switch_is_documented_in_the_configuration_page_with_its_type_and_default():
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = {cells[1].strip("`"): cells[2:4] for line in page.splitlines()
            if (cells := [c.strip() for c in line.split("|")])[1:2] and cells[1].startswith("`SPECSERVE_")}
    assert set(rows) == set(envs.documentation())
    for field in fields(envs.Switches):
        kind, default = rows[envs.env_name(field.name)]
        if isinstance(field.default, bool):
            assert (kind, default) == ("bool", "`1`" if field.default else "`0`"), field.name
        else:
            assert (kind, default) == ("string", f"`{field.default}`" if field.default else "none"), field.name
    assert not set(re.findall(r"SPECSERVE_[A-Z0-9_]+", page)) - set(rows), "the page names a switch that is gone"


def test_values_parse_by_the_switchs_type():
    for text in ("1", "true", "Yes", " ON "):
        assert envs.parse("fused_topk", text) is True
    for text in ("0", "false", "No", "off"):
        assert envs.parse("fused_topk", text) is False
    assert envs.parse("fused_topk", "") is True  # set but empty: the default
    with pytest.raises(ValueError, match="SPECSERVE_FUSED_TOPK"):
        envs.parse("fused_topk", "2")
    assert envs.parse("gemv_choices", "/tmp/h200.json") == "/tmp/h200.json"
    assert envs.parse("gemv_choices", "") == ""  # a string switch keeps its text: here, time every shape


def test_an_environment_sets_the_switches_it_names_and_the_rest_keep_their_defaults(caplog):
    switches = envs.read({"SPECSERVE_CPU_KERNELS": "0", "SPECSERVE_GEMV_CHOICES": "none", "PATH": "/bin"})
    assert switches == envs.Switches(cpu_kernels=False, gemv_choices="none")
    with caplog.at_level("WARNING", logger="specserve.envs"):
        assert envs.read({"SPECSERVE_PDL": "0"}) == envs.Switches()  # a switch that was removed
    assert "SPECSERVE_PDL is not a switch" in caplog.text


def test_override_sets_switches_for_its_block_and_nests():
    before = envs.get()
    with envs.override(fused_topk=not before.fused_topk) as inside:
        assert envs.get() is inside and inside.fused_topk != before.fused_topk
        with envs.override(fold_norms=False):
            assert not envs.get().fold_norms and envs.get().fused_topk == inside.fused_topk
        assert envs.get() is inside
    assert envs.get() is before
    with pytest.raises(TypeError, match="no switch"):
        with envs.override(no_such_switch=True):
            pass
    with pytest.raises(TypeError, match="takes a bool"):
        with envs.override(fused_topk="0"):
            pass


def test_the_switches_fixture_sets_them_for_the_test(switches):
    switches(closed_tails=False, gemv_choices="none")
    assert not envs.get().closed_tails and envs.get().gemv_choices == "none"


def test_no_module_but_envs_reads_a_switch_from_the_environment():
    # os.environ["SPECSERVE_..."], os.environ.get("SPECSERVE_..."), os.getenv("SPECSERVE_..."), "SPECSERVE_..." in
    # os.environ, monkeypatch.setenv("SPECSERVE_...") and the like, anywhere in the package, the benchmarks or the
    # tests (this file and envs.py aside).
    read = re.compile(r"(environ|getenv|setenv|delenv)\b[^\n]{0,40}SPECSERVE_|SPECSERVE_\w*[\"'] (not )?in os\.environ")
    offenders = []
    for folder in ("specserve", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name in ("envs.py", "test_envs.py"):
                continue
            offenders += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                          if read.search(line)]
    assert not offenders, "read SPECSERVE_ switches through specserve.envs:\n" + "\n".join(offenders)
