"""Hand-written CPU kernels (csrc/), compiled on first use with the machine's C++ compiler and cached.

- `linear`: fp32 GEMM for few-row inputs (csrc/cpu_gemm.cpp). It streams each weight once, closer to the
  memory's streaming rate than oneDNN's pre-packed GEMM gets on such shapes (docs/performance.md, "The CPU").
- `paged_attention`: short queries (decode, chain verification) straight from the paged KV cache
  (csrc/cpu_attention.cpp), replacing the gather + padded SDPA of the reference path.
- `rms_norm`, `rotary_`, `silu_and_mul`: the elementwise math between the matmuls, one pass each
  (csrc/cpu_pointwise.cpp).

Without a compiler, without AVX2, or with SPECSERVE_CPU_KERNELS=0, `kernels()` returns None and callers keep
the PyTorch paths.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from specserve import envs

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("bindings.cpp", "cpu_gemm.cpp", "cpu_attention.cpp", "cpu_pointwise.cpp")]
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


@functools.cache
def kernels():
    """The compiled module (`pack`, `linear`, `paged_attention`, `rms_norm`, `rotary_`, `silu_and_mul`), or
    None where it cannot run here."""
    if not envs.get().cpu_kernels:
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: CPU decode uses oneDNN and SDPA (slower at small batch)")
        return None
    from torch.utils.cpp_extension import is_ninja_available, load

    if not is_ninja_available():
        _put_pip_ninja_on_path()
    log.info("compiling the CPU kernels (about a minute, once; cached afterwards)")
    try:
        # The sources' hash is part of the name, so an edited kernel never reuses a stale build.
        sources = sorted(_SOURCES[0].parent.iterdir())  # the headers count too
        name = "specserve_cpu_" + hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:10]
        _remove_stale_lock(name)
        return load(name, [str(path) for path in _SOURCES], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as error:  # a broken toolchain must not stop serving
        log.warning("CPU kernels failed to build (%s): CPU decode uses oneDNN and SDPA", error)
        return None


def _put_pip_ninja_on_path() -> None:
    """torch builds extensions with ninja; the `ninja` wheel ships the binary outside a non-activated PATH."""
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _remove_stale_lock(name: str, max_age_s: float = 600.0) -> None:
    """torch waits without a timeout on a build's lock file; one left by a build that was killed would hang
    every later start. A build takes about a minute, so a lock older than `max_age_s` is a leftover."""
    from torch.utils.cpp_extension import get_default_build_root

    lock = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
            log.warning("removed a stale CPU-kernel build lock (%s)", lock)
    except FileNotFoundError:
        pass
