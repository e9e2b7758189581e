"""Which GEMV runs for each weight shape: a Triton tile (kernels/triton/gemv.py) or cuBLAS, by timing.

Each call form (weight shape and dtype, row bucket, gate/up, a folded norm) is decided the first time it is
seen, by timing every candidate tile and cuBLAS inside a CUDA graph (the way decode steps run: without launch
overhead, which would otherwise hide a kernel of a few microseconds) over enough copies of the weight that none
of it is served from L2 (decode reads each weight once a step). Decisions measured for a GPU ship with the
package (tuning/choices.py, tuning/decisions/) and are taken instead of timing, unless SPECSERVE_GEMV_CHOICES
says otherwise (docs/configuration.md). `choice` is the process's chooser; layers/linear.py asks it for each
call's tile and decides a model's shapes at startup (`decide_gemv_tiles`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
import triton

from specserve import envs
from specserve.kernels import pointwise
from specserve.kernels.fp8 import FP8, dense_linear
from specserve.kernels.triton.gemv import TensorDescriptor, gemv, split_fits, tma_ok
from specserve.kernels.tuning import choices as gemv_choices
from specserve.kernels.tuning.choices import Tile

# One row: FMAs on CUDA cores; several rows: a tensor-core dot with the rows padded to 16.
ONE_ROW_TILES = [Tile(n, k, w, s) for n, k in ((4, 512), (8, 256), (8, 512), (16, 256), (16, 512), (32, 256))
                 for w, s in ((4, 3), (4, 5), (8, 4))]
# The row tiles that came within 2 % of the best on some 8B shape at 4 or 16 rows (the 128-wide ones for the
# gate/up form, which streams two weight tiles), and one narrow tile for small models.
ROWS_TILES = [Tile(16, 256, 4, 3), Tile(32, 128, 4, 3), Tile(32, 128, 4, 5), Tile(32, 256, 4, 4), Tile(32, 256, 4, 5),
              Tile(64, 128, 4, 3), Tile(64, 128, 4, 4), Tile(64, 256, 4, 4), Tile(128, 128, 4, 3),
              Tile(128, 128, 8, 3)]
# The same rows with the weight as the dot's left operand (M = BLOCK_N, at least 64: one warpgroup's rows): for
# Hopper that compiles to a wgmma with both operands in shared memory and fewer registers; with the rows on the
# left (above) it is an Ampere-style mma of 16 padded rows, its weight operand in registers.
SWAP_TILES = [Tile(n, k, w, s, swap=True) for n, k, w, s in
              ((64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (128, 64, 4, 5), (128, 128, 4, 3), (128, 128, 8, 4))]
# The swapped form with its weight tiles brought by the Hopper TMA (gemv._gemv_tma_kernel): timed alone, the best
# of these beat every other tile on each 8B shape at 4 rows. Needs sm_90 and a weight whose rows start 16-byte
# aligned; elsewhere (and for fp8 weights) a decisions file's TMA tiles run with ordinary loads.
TMA_TILES = [Tile(n, k, 4, s, swap=True, tma=True) for n, k, s in
             ((64, 128, 4), (64, 128, 6), (64, 256, 3), (64, 256, 4), (128, 128, 3), (128, 128, 6))]
# One-row tiles for fp8 weights (a draft head's), which bring half the bytes a tile: these keep as many in flight as
# the 16-bit ones above by reaching twice as far along K. Several-row tiles twice as long along K, or of 8 warps,
# never won for fp8 weights, so they are not candidates.
FP8_ONE_ROW_TILES = [Tile(n, 1024, w, s) for n, w, s in ((4, 8, 4), (8, 4, 3), (16, 8, 4))]
# Split over K (gemv._store_split): each output tile's row slice reduced by `split_k` programs, the last one in
# adding up their partial sums. Unsplit, a weight of few output tiles leaves SMs idle or unevenly loaded (on a
# GPU of 132 SMs a 4096 x 4096 weight in 64-wide tiles is 64 programs; a 6144-wide one in 32-wide tiles, 192, a
# wave and a half), and each program streams a whole row; split, there are more, shorter programs.
SPLIT_ROWS_TILES = [replace(t, split_k=s) for t in (Tile(32, 256, 4, 4), Tile(64, 128, 4, 4)) for s in (2, 4)]
SPLIT_TMA_TILES = [replace(t, split_k=s) for t in (TMA_TILES[0], TMA_TILES[2], TMA_TILES[4]) for s in (2, 4)]
# Swapped tiles are not timed for forms that scale x by a folded norm's weight: timed alone they won at 2-16
# rows, yet a 4-row chain verify was slower with them than with those norms as kernels of their own and swapped
# tiles elsewhere, timed by the step's own time (set this to keep timing them). Folds whose norm
# weight is in the projection's (SPECSERVE_NORM_IN_WEIGHTS) leave x as loaded, and they are timed there.
SWAP_IN_FOLDS = False

# Row counts are decided per bucket, each timed at its own size: cuBLAS and the tiles scale differently with
# the rows, so one decision for every count above one, timed at two rows, need not hold for a 4-row chain verify.
ROW_BUCKETS = (1, 2, 4, 8, 16)
NORM_APART = "norm apart"  # a folded norm's call timed as a norm kernel, then the best form without the norm
NO_FILE = ("", "0", "none", "off")  # SPECSERVE_GEMV_CHOICES values that time every shape


def _cublas(x: torch.Tensor, weight: torch.Tensor, gate_up: bool = False,
            norm_weight: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """What a call takes where no tile runs: the norm and SiLU-and-multiply as kernels of their own (an fp8
    weight widened to x's type first: `dense_linear`)."""
    if norm_weight is not None:
        x = pointwise.rms_norm(x, norm_weight, 1e-5)
    out = dense_linear(x, weight, scale)
    return pointwise.silu_and_mul(out) if gate_up else out


class Choice:
    """Per (weight shape, dtype, row bucket, gate/up form, RMSNorm folded or not, a folded norm's weight applied
    in the kernel or already in the weight): the fastest Tile, or None where cuBLAS won (or, for a folded
    norm, the norm apart did). Each candidate is timed as the call would run it: a call that folds a norm against
    cuBLAS after a norm kernel and against the best unfolded form after one, the gate/up form against cuBLAS and
    a SiLU-and-multiply kernel. A call during CUDA-graph capture cannot time anything, so an undecided shape takes
    cuBLAS there (the graphs' warm-up runs decide the shapes they use before capturing); so does one inside
    `untimed()`, which serving steps run in: timing clones the weight, captures a graph and synchronises, which
    no step should wait for (layers/linear.decide_gemv_tiles decides every shape at startup instead).

    `cublas_margin`: cuBLAS is chosen only where it times this many times faster than the best tile (tests
    take inf to run tiles everywhere). `norm_apart`: a folded norm's call is also timed as the norm apart, then
    the best form without it."""

    def __init__(self, saved: str | None = None, cublas_margin: float = 1.0, norm_apart: bool = True) -> None:
        self.cublas_margin = cublas_margin
        self.norm_apart = norm_apart
        self.best: dict[tuple, Tile | None] = {}
        self.timings: dict[tuple, dict[str, float]] = {}  # microseconds per call, for benchmarks to report
        self._timing_allowed = True
        # Under tensor parallelism: each rank's timings -> the ones every rank decides by (rank 0's), so every rank
        # runs the same kernel on its replicated weights (the draft head) and they stay bitwise equal.
        self.agree = None
        # A decisions file, or "shipped" for this GPU's (read at the first decision, on the GPU it names; then
        # "shipped: NAME", or None where there are none); None: every shape is timed.
        self.saved = None if saved is None or saved.strip().lower() in NO_FILE else saved
        self._unread = self.saved

    @contextmanager
    def untimed(self):
        allowed, self._timing_allowed = self._timing_allowed, False
        try:
            yield
        finally:
            self._timing_allowed = allowed

    @staticmethod
    def key(x: torch.Tensor, weight: torch.Tensor, gate_up: bool = False, norm: bool = False,
            gamma: bool = True) -> tuple:
        """`gamma`: a folded norm's weight is applied in the kernel (False: it is in `weight` already)."""
        rows = next(b for b in ROW_BUCKETS if x.shape[0] <= b)
        return tuple(weight.shape), weight.dtype, rows, gate_up, norm, norm and gamma

    def tile(self, x: torch.Tensor, weight: torch.Tensor, gate_up: bool = False, norm: bool = False,
             gamma: bool = True) -> Tile | None:
        if self._unread:  # once, even if it fails: its error stops the startup that met it
            path, self._unread = self._unread, None
            device = torch.cuda.get_device_name(x.device)
            if path == "shipped":  # made under the chooser's defaults, so only taken under them
                path = gemv_choices.shipped(device) if self.at_defaults() else None
                self.saved = path and f"shipped: {path.name}"
            if path:
                self.best = {**gemv_choices.load(path, device), **self.best}
        key = self.key(x, weight, gate_up, norm, gamma)
        if key not in self.best:
            if torch.cuda.is_current_stream_capturing() or not self._timing_allowed:
                return None
            self.best[key] = self._measure(key, x, weight, gate_up, norm, key[-1])
        return self.best[key]

    def at_defaults(self) -> bool:
        """Whether this chooser and the switches the decisions depend on are at their defaults, as when the
        shipped decisions were made: an A/B of one would otherwise be hidden for the shapes they hold."""
        switches = envs.get()
        return (self.cublas_margin == 1.0 and self.norm_apart and switches.gemv_fp8_bits and switches.fold_norms
                and switches.norm_in_weights)

    def report(self) -> list[dict]:
        """Each decided call form: what was chosen and, where it was timed here, cuBLAS's time and the best
        tile's in microseconds (decisions from a file were not timed)."""
        rows_out = []
        for (shape, dtype, rows, gate_up, norm, gamma), tile in self.best.items():
            t = self.timings.get((shape, dtype, rows, gate_up, norm, gamma))
            row = {"weight": list(shape), "dtype": str(dtype).removeprefix("torch."), "rows": rows, "gate_up": gate_up,
                   "norm": norm, "gamma_in_kernel": gamma, "chosen": str(tile)}
            if t is None:  # taken from the decisions file, or set by a benchmark
                row["not_timed_here"] = True
                row["decisions_file"] = self.saved
            else:
                row["cublas_us"] = round(t["cublas"], 2)
                row["best_tile_us"] = round(min((v for n, v in t.items() if n not in ("cublas", NORM_APART)),
                                                default=float("nan")), 2)
                if NORM_APART in t:
                    row["norm_apart_us"] = round(t[NORM_APART], 2)
            rows_out.append(row)
        return rows_out

    def _measure(self, key: tuple, x: torch.Tensor, weight: torch.Tensor, gate_up: bool, norm: bool,
                 gamma: bool) -> Tile | None:
        # A folded norm is also timed as the norm in a kernel of its own before the best form without it, which is
        # what the call runs where no fold is chosen (Linear._forward_gpu): folded, x passes through registers to be
        # scaled, which made an fp8 head's lm_head slower folded than apart.
        apart = self.tile(x, weight, gate_up) if norm and self.norm_apart else None
        copies = [weight] + [weight.clone() for _ in range(min(-(-256 * 2**20 // _nbytes(weight)), 400) - 1)]
        ones = torch.ones(x.shape[1], dtype=x.dtype, device=x.device) if norm else None
        in_kernel = ones if gamma else None
        scale = torch.ones(weight.shape[0], device=x.device) if weight.dtype == FP8 else None
        # TMA tiles need a 16-bit weight (else they would be timed as tiles with ordinary loads).
        tiles = {str(tile): tile for tile in candidate_tiles(x.shape[0], norm, gamma, scale is not None)
                 if (not tile.tma or (tma_ok(weight) and scale is None)) and split_fits(weight.shape[1], tile)}
        candidates = {"cublas": lambda w: _cublas(x, w, gate_up, ones, scale)}
        candidates |= {name: (lambda w, tile=tile: gemv(x, w, tile, norm_weight=in_kernel, eps=1e-5,
                                                        gate_up=gate_up, norm=norm, scale=scale))
                       for name, tile in tiles.items()}
        if apart is not None:
            candidates[NORM_APART] = lambda w: gemv(pointwise.rms_norm(x, ones, 1e-5), w, apart, gate_up=gate_up,
                                                    scale=scale)
        times = {}
        for name, fn in candidates.items():
            try:
                times[name] = graph_time(fn, copies) * 1e3
            except triton.runtime.errors.OutOfResources:  # a tile too large for this form (two weight tiles)
                continue
        if self.agree is not None:
            times = self.agree(times)
        self.timings[key] = times
        del copies
        return pick(times, tiles, self.cublas_margin)


def pick(times: dict[str, float], tiles: dict[str, Tile], cublas_margin: float = 1.0) -> Tile | None:
    """The fastest of `tiles` (by name) among those `times` holds, or None (cuBLAS, and a folded norm apart)
    where none was timed, or cuBLAS ("cublas" in `times`) beats it by `cublas_margin`, or the norm apart
    (NORM_APART) beats it."""
    timed = [name for name in times if name in tiles]
    if not timed:
        return None
    best = min(timed, key=times.get)
    if times.get(NORM_APART, float("inf")) < times[best]:
        return None
    return None if times["cublas"] * cublas_margin < times[best] else tiles[best]


def candidate_tiles(rows: int, norm: bool = False, gamma: bool = True, fp8: bool = False) -> list[Tile]:
    """The tiles the chooser times for a call of `rows` rows (`norm`: with a norm folded in; `gamma`: its
    weight applied in the kernel; `fp8`: an fp8 weight, which at one row also takes FP8_ONE_ROW_TILES)."""
    if rows == 1:
        return ONE_ROW_TILES + (FP8_ONE_ROW_TILES if fp8 else [])
    swapped = SWAP_IN_FOLDS or not (norm and gamma)
    tma = swapped and TensorDescriptor is not None
    tiles = ROWS_TILES + (SWAP_TILES if swapped else []) + (TMA_TILES if tma else [])
    return tiles + SPLIT_ROWS_TILES + (SPLIT_TMA_TILES if tma else [])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def graph_time(fn, weights: list[torch.Tensor], replays: int = 5) -> float:
    """Milliseconds per call of fn(w), run for each of `weights` in turn inside one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # compiles, and lets cuBLAS pick its kernel, outside the capture
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * len(weights))


choice = Choice(envs.get().gemv_choices)
