"""The scripts in benchmarks/ stay runnable: each imports on a machine without a GPU or Triton, has a main guard,
reaches specserve only through public names and imports no test helper; each shell script parses, and names only
scripts that exist."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
SHELL_SCRIPTS = sorted(BENCHMARKS.glob("*.sh"))
# Modules a benchmark must not import: the tests' helpers and fixtures.
TEST_MODULES = {"tests", "conftest"} | {path.stem for path in (ROOT / "tests").rglob("*.py")}

# Imports every script by its path, as `python benchmarks/NAME.py` would before main() (so with benchmarks/ on
# the path), with Triton unimportable and no GPU visible; prints each script's traceback, or null.
_IMPORT_EACH = """
import importlib.util, json, sys, traceback
sys.modules["triton"] = None
sys.path.insert(0, sys.argv[1])
errors = {}
for path in sys.argv[2:]:
    spec = importlib.util.spec_from_file_location("benchmark_" + path.rsplit("/", 1)[-1][:-3], path)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        errors[path] = None
    except BaseException:
        errors[path] = traceback.format_exc()
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def import_errors() -> dict[str, str | None]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _IMPORT_EACH, str(BENCHMARKS), *map(str, SCRIPTS)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(tree: ast.Module) -> list[str]:
    """Private attributes read or written (`x._name`, or getattr and friends with a literal `"_name"`), and private
    names imported from specserve."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specserve":
            parts = node.module.split(".") + [alias.name for alias in node.names]
            found += [f"line {node.lineno}: from {node.module} import {part}" for part in parts if _private(part)]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {alias.name}" for alias in node.names
                      if alias.name.split(".")[0] == "specserve" and any(map(_private, alias.name.split(".")))]
    return found


def _imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defined_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (inside if and try blocks too), and the names its
    module-level __getattr__ compares against."""
    tree, names = _tree(path), set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                names |= {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", [])
            body += [n for handler in getattr(node, "handlers", []) for n in handler.body]
    return names


def _missing_specserve_names(tree: ast.Module) -> list[str]:
    """specserve modules and names a script imports (at any depth: GPU-only imports sit inside functions) that do
    not exist, found without importing them."""
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            missing += [alias.name for alias in node.names
                        if alias.name.split(".")[0] == "specserve" and _module_file(alias.name) is None]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specserve":
            path = _module_file(node.module)
            if path is None:
                missing.append(node.module)
                continue
            names = _defined_names(path)
            missing += [f"{node.module}.{alias.name}" for alias in node.names
                        if alias.name not in names and _module_file(f"{node.module}.{alias.name}") is None]
    return missing


def _has_main_guard(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"',
                                                                       "__name__ == '__main__'")
               for node in tree.body)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_without_a_gpu_or_triton(script, import_errors):
    assert import_errors[str(script)] is None, import_errors[str(script)]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_only_under_its_main_guard(script):
    assert _has_main_guard(_tree(script))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_uses_only_public_names(script):
    assert _private_uses(_tree(script)) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_only_what_specserve_has(script):
    assert _missing_specserve_names(_tree(script)) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_no_test_helper(script):
    tree = _tree(script)
    assert not _imported_modules(tree) & TEST_MODULES
    assert "tests" not in {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(script):
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_names_only_scripts_that_exist(script):
    named = set(re.findall(r"benchmarks/([\w.-]+\.(?:py|sh))\b", script.read_text()))
    assert {name for name in named if not (BENCHMARKS / name).is_file()} == set()


def test_the_checks_catch_what_they_look_for():
    bad = ast.parse("import conftest\nfrom specserve.bench.serving import _one\nimport specserve._x\n"
                    "engine._postprocess(1)\ngetattr(runner, '_metas')\nx.__class__\n")
    assert len(_private_uses(bad)) == 4
    assert _imported_modules(bad) & TEST_MODULES == {"conftest"}
    assert not _has_main_guard(bad)
    assert _has_main_guard(ast.parse('if __name__ == "__main__":\n    main()\n'))
    moved = ast.parse("def f():\n    from specserve.llm import LLM, no_such_name\n    import specserve.no_such_module\n"
                      "from specserve import LLM, SamplingParams, bench\n")
    assert _missing_specserve_names(moved) == ["specserve.llm.no_such_name", "specserve.no_such_module"]
