"""First use after an install: Numba compiles the reference's kernels, visibly, before serving.

Numba compiles a kernel at its first call and caches it next to the sources (`__pycache__`,
*.nbi/*.nbc), so only a fresh install (or a new CPU or Numba) pays: on two cores about 10 s for
a decode pass, and about 15 s more for the threaded kernels the first pass of PARALLEL_ROWS or
more rows runs. `report_compiles` prints a line per kernel compiled, whenever that happens, so
the wait is never a silent stall; `warm_up` runs one decode pass through a scratch backend, so
the server compiles (or loads from the cache) what every request needs before it listens.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from numba.core import event

from ..backend import Row, StepPlan

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


WARM_ROWS = 8  # past the first ratio-4 compression (the indexer's rotation, compact index rows)


def warm_up(reference) -> float:
    """A pass of WARM_ROWS rows (BOS at positions 0..7) and a decode row after it, through a
    scratch NumpyBackend of one slot and one page over `reference` (a reference Model): the
    kernels of a short prompt and of decode, in the serving storage, compiled or loaded from
    the cache. Fewer than PARALLEL_ROWS rows, so the threaded kernels are left to the first
    long prompt pass. Returns the seconds it took; the serving backend is not touched."""
    from .numpy_backend import NumpyBackend
    t0 = time.perf_counter()
    backend = NumpyBackend(reference)
    backend.configure(1, 1)
    backend.set_block_table(0, [0])
    bos = reference.config.bos_id
    last = [p == WARM_ROWS - 1 for p in range(WARM_ROWS)]
    backend.step(StepPlan.from_rows([Row(0, p, bos, last[p], last[p]) for p in range(WARM_ROWS)],
                                    backend.max_pass_rows))
    backend.step(StepPlan.from_rows([Row(0, WARM_ROWS, bos)], backend.max_pass_rows))
    return time.perf_counter() - t0
