"""Every SPECSERVE_* environment switch: its type, default and meaning, in one place.

The environment is read once, when this module is imported. Code asks `get()` for the typed values where it
decides (a kernel launch, a graph capture, a model load), never os.environ; tests change them with
`override(...)`, never through os.environ or another module's globals. docs/configuration.md describes each
switch for users, and a test keeps that page and this module in step.

A boolean switch takes 1, true, yes or on, and 0, false, no or off (any case); set but empty, it keeps its
default. A string switch takes its text as given.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

log = logging.getLogger(__name__)

PREFIX = "SPECSERVE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _switch(default: bool | str, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Switches:
    """The switches' values; field `name` is set by the environment variable SPECSERVE_<NAME>."""

    # Real settings.
    cpu_kernels: bool = _switch(
        True, "Compile (once, cached) and use the C++ CPU kernels: the few-row GEMM, decode attention and the "
              "pointwise math. Off: PyTorch with oneDNN's packed weights.")
    gemv_choices: str = _switch(
        "shipped", "Which GEMV tile decisions to take instead of timing: `shipped` (those in the package for "
                   "this GPU, if any), the path of a file saved on this GPU, or `0`, `none`, `off` or an empty "
                   "value to time every shape at startup.")
    triton_gemv: bool = _switch(
        True, "Run GPU matmuls of at most 16 rows through the Triton GEMV for the shapes where it timed faster "
              "than cuBLAS. Off: cuBLAS for every shape.")
    api_key: str = field(default="", repr=False, metadata={"doc": (
        "The key `specserve serve` requires, as `--api-key` does (which wins when both are set); in the "
        "environment it does not show in `ps`. Empty: no key.")})
    # The PyTorch or unfused forms that tests and benchmarks hold the defaults to.
    fold_norms: bool = _switch(
        True, "In bf16 on a GPU, fold a decoder layer's RMSNorms and residual adds into the GEMVs around "
              "them. Off: each norm is a kernel of its own.")
    norm_in_weights: bool = _switch(
        True, "Where norms fold, multiply each norm's weight into the projections after it at load, so the "
              "GEMV only scales by the reciprocal RMS. Off: the GEMV applies the norm's weight.")
    gemv_fp8_bits: bool = _switch(
        True, "On sm_90 and later, GEMVs of several rows widen fp8 weights by moving bits. Off: by Triton's "
              "conversion, as one-row GEMVs and older GPUs do.")
    fused_topk: bool = _switch(
        True, "The tree search's log_softmax and top-k in two Triton kernels on a GPU. Off: PyTorch's.")
    fused_search: bool = _switch(
        True, "The tree program's search, selection and greedy acceptance in Triton kernels on a GPU. Off: "
              "the PyTorch form the CPU runs.")
    fused_follow: bool = _switch(
        True, "The inputs of rows that continue the last launch, derived in one Triton kernel on a GPU. Off: "
              "the PyTorch form the CPU runs.")
    fused_moe: bool = _switch(
        True, "MoE layers on a GPU in Triton: routing, the pairs' layout, the expert GEMMs and the weighted "
              "sum. Off: the PyTorch forms (inside CUDA graphs each pair then gathers its expert's weights).")
    moe_pair_gemv: bool = _switch(
        True, "MoE layers of a few rows on a GPU (decode) as one GEMV per token-expert pair, the routing and the "
              "weighted sum inside them. Off: the grouped GEMMs at every size.")
    moe_gemv_tiles: str = _switch(
        "", "The pair GEMVs' tiles, `block_n,block_k,warps;block_n,block_k,warps` (gate-up; down-sum), for "
            "benchmarks that sweep them. Empty: the defaults of kernels/triton/moe_decode.py.")
    closed_tails: bool = _switch(
        True, "A verified tree's tails attended as one block, each row masked to its own path. Off: each "
              "row's tail apart.")
    tree_program_on_cpu: bool = _switch(
        False, "Run EAGLE-3 tree steps as the tree program on a CPU too, as on a GPU. Off: the general search, "
               "which is faster where a read-back costs nothing.")
    chain_shared_context: bool = _switch(
        True, "On a GPU, a chain step's catch-up and verified rows of a sequence attend as one run over the "
              "context before them. Off: each row on its own, like a decode row.")
    forced_drafts: bool = _switch(
        True, "Under structured output, verify the text a grammar forces next (a schema's keys and "
              "punctuation, as the tokenizer encodes it) as the first drafts of a step, with or without "
              "speculation, where steps run eagerly (a CPU: with CUDA graphs a span would cost more than it saves). "
              "Off: one token a step without speculation; the drafter drafts it through its masks.")
    program_masks: bool = _switch(
        True, "Rows under a grammar run in the chain and tree step programs, in parts (draft levels, each "
              "followed by masks built on the host, then masked verification). Off: they take the general path.")
    # Tests only.
    triton_interpreter_tests: bool = _switch(
        False, "Run the slowest of the Triton kernels' tests in Triton's CPU interpreter "
               "(tests/kernels/test_triton_interpreter.py: whole tree programs, tile sweeps). Off: those skip, "
               "the rest run.")


def env_name(name: str) -> str:
    """The environment variable of switch `name` (`fused_topk` -> SPECSERVE_FUSED_TOPK)."""
    return PREFIX + name.upper()


def documentation() -> dict[str, str]:
    """Environment variable -> what its switch does."""
    return {env_name(f.name): f.metadata["doc"] for f in fields(Switches)}


def parse(name: str, text: str) -> bool | str:
    """The value `text` sets switch `name` to (see the module's docstring)."""
    default = _DEFAULTS[name]
    if not isinstance(default, bool):
        return text
    word = text.strip().lower()
    if not word:
        return default
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"{env_name(name)}={text!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def read(environ: Mapping[str, str]) -> Switches:
    """The switches an environment sets. A SPECSERVE_ variable that names no switch is logged and ignored."""
    names = {env_name(name): name for name in _DEFAULTS}
    for variable in sorted(set(environ) - set(names)):
        if variable.startswith(PREFIX):
            log.warning("%s is not a switch (docs/configuration.md lists them); it has no effect", variable)
    return Switches(**{name: parse(name, environ[variable]) for variable, name in names.items()
                       if variable in environ})


def get() -> Switches:
    """The switches in force: the environment's at import, or an `override`'s inside one."""
    return _current


@contextmanager
def override(**values: bool | str) -> Iterator[Switches]:
    """Sets switches (by field name) until the block ends: `with envs.override(fused_topk=False): ...`."""
    global _current
    for name, value in values.items():
        if name not in _DEFAULTS:
            raise TypeError(f"no switch named {name!r}")
        if type(value) is not type(_DEFAULTS[name]):
            raise TypeError(f"switch {name} takes a {type(_DEFAULTS[name]).__name__}, not {value!r}")
    before, _current = _current, replace(_current, **values)
    try:
        yield _current
    finally:
        _current = before


_DEFAULTS = {f.name: f.default for f in fields(Switches)}
_current = read(os.environ)
