"""First use after an install: Numba compiles the reference's kernels, visibly, before serving.

Numba compiles a kernel at its first call and caches it next to the sources (`__pycache__`,
*.nbi/*.nbc), so only a fresh install (or a new CPU or Numba) pays: on two cores about 10 s for
a decode pass, and about 15 s more for the threaded kernels a pass of PARALLEL_ROWS or more rows
runs. `report_compiles` prints a line per kernel compiled, whenever that happens, so the wait
is never a silent stall; `warm_up` runs passes through a scratch backend that reach every kernel
a request can reach, so the server compiles (or loads from the cache) all of them before it
listens.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
import time
from typing import Callable

from numba.core import event

from ..backend import PAGE_TOKENS, PREFILL_ROWS, DraftRequest, Row, StepPlan
from ..gguf.config import CSA
from ..numerics.canon import PARALLEL_ROWS

_registered: list = []


class CompileReport(event.Listener):
    """One line per top-level compile (a kernel with the kernels it calls), with its time."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write = write
        self._local = threading.local()
        self.compiled: list[tuple[str, float]] = []

    def on_start(self, ev) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.t0 = time.perf_counter()
            if not self.compiled:
                self.write("numba: compiling the NumPy reference's kernels (first use after an install; "
                           "cached next to the sources for later starts)")
        self._local.depth = depth + 1

    def on_end(self, ev) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            d = ev.data.get("dispatcher")
            func = getattr(d, "py_func", None)
            name = f"{func.__module__.rsplit('.', 1)[-1]}.{func.__name__}" if func is not None else "kernel"
            seconds = time.perf_counter() - self._local.t0
            self.compiled.append((name, seconds))
            self.write(f"numba: compiled {name} in {seconds:.1f} s")


def report_compiles(write: Callable[[str], None]) -> CompileReport:
    """Report every Numba compile of this process from now on through `write`."""
    listener = CompileReport(write)
    event.register("numba:compile", listener)
    _registered.append(listener)
    return listener


def stop_reporting(listener: CompileReport) -> None:
    event.unregister("numba:compile", listener)
    _registered.remove(listener)


WARM_TOP_K = 1  # the scratch model's indexer threshold: its kernels, reached a few rows in


def _first_pick(top_k: int) -> int:
    """The first position whose query sees more than top_k ratio-4 rows, so the indexer picks."""
    return CSA * (top_k + 1) - 1


WARM_ROWS = _first_pick(WARM_TOP_K) + 1  # 8: a short prompt pass whose last row picks


def scratch_model(reference):
    """A reference Model over the same weights (shared, not copied) whose indexer picks past
    WARM_TOP_K rows instead of the config's top_k (512 for Flash: 2051 positions). Numba compiles
    a kernel per argument types, never per length, so a short pass through it reaches the very
    kernels and signatures a long prompt reaches, at a cost of a few rows."""
    from .model import Model
    weights = copy.copy(reference.weights)  # the tensors and their caches are shared
    weights.config = dataclasses.replace(reference.config, indexer_top_k=WARM_TOP_K)
    return Model(weights, reference.numerics)


def warm_up(reference, mtp=None, max_pass_rows: int = PREFILL_ROWS) -> float:
    """Every Numba kernel a request can reach, compiled or loaded from the cache, through a
    scratch NumpyBackend of one slot over `scratch_model(reference)` (a reference Model), in the
    serving storage:
    - a prompt pass of WARM_ROWS rows (BOS at positions 0..7) whose last row is past the
      indexer's threshold, then a decode row: the sequential kernels, the indexer's included;
    - where the server's passes may hold PARALLEL_ROWS rows (max_pass_rows), a pass of
      PARALLEL_ROWS rows, every one of them picking: the threaded twins (`*_par`);
    - mtp (the serving backend's MTP block, when the server speculates): after each pass, its
      rows fed to the MTP block and two drafts, the second a chained single-row step.
    Returns the seconds it took; the serving backend is not touched."""
    from .mtp import MTP
    from .numpy_backend import NumpyBackend
    t0 = time.perf_counter()
    model = scratch_model(reference)
    passes = [WARM_ROWS, 1] + ([PARALLEL_ROWS] if max_pass_rows >= PARALLEL_ROWS else [])
    backend = NumpyBackend(model, max(passes), None if mtp is None else MTP(model, mtp.weights))
    backend.configure(1, -(-sum(passes) // PAGE_TOKENS))
    backend.set_block_table(0, list(range(backend.n_pages)))
    bos, first = reference.config.bos_id, 0
    for n in passes:
        positions = range(first, first + n)
        backend.step(StepPlan.from_rows([Row(0, p, bos, p == positions[-1], p == positions[-1])
                                         for p in positions], backend.max_pass_rows))
        if mtp is not None:
            backend.draft([DraftRequest(0, tuple(positions), (bos,) * n, 2)])
        first += n
    return time.perf_counter() - t0
