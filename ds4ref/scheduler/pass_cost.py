"""What a pass costs, so the Scheduler can size a prompt's share of it (docs/scheduler.md).

A pass's wall time is modelled as `fixed_ms + row_ms * lanes`, where lanes are the rows the
backend actually runs (HipBackend pads a pass to its capacity bucket). Beside decoders, the
Scheduler gives prompts the most rows whose pass this model predicts within the inter-token
budget (`max_itl_ms`): Sarathi-Serve's stall-free batching, with the token budget derived from
the latency target instead of set by hand.

`PassCost` is a given model: it learns nothing, so a schedule under it depends only on the
requests (tests inject one). `MeasuredPassCost` starts from a prior and fits the line to the
passes the engine times.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..backend import DECODE_LANES

LONG_PASS_ROWS = 2048  # a lone prompt's pass when serving: 2048 rows x top-6 of 256 experts = 48 rows an expert
DEFAULT_MAX_ITL_MS = 200.0  # docs/scheduler.md "How passes are sized" says why
MIN_PROMPT_ROWS = DECODE_LANES  # prompt rows a pass beside decoders holds at least: prompts never starve


@dataclass(frozen=True)
class PassCost:
    """A pass of `lanes` rows takes fixed_ms + row_ms * lanes milliseconds."""
    fixed_ms: float
    row_ms: float

    def __post_init__(self) -> None:
        if not (self.fixed_ms >= 0 and self.row_ms > 0):
            raise ValueError(f"a pass cost needs fixed_ms >= 0 and row_ms > 0, got {self.fixed_ms}, {self.row_ms}")

    def ms(self, lanes: int) -> float:
        return self.fixed_ms + self.row_ms * lanes

    def observe(self, lanes: int, ms: float) -> None:
        """A given model learns nothing from the passes it sizes."""


# H200, Flash in the q2 policy, HipBackend (benchmarks/prefill_gpu.py, decode_gpu.py): a 16-lane
# decode pass 37.8 ms, a 256-row prompt pass 351 ms. Only the first passes use it: one measured
# size rescales it, two replace it.
FLASH_H200 = PassCost(fixed_ms=16.9, row_ms=1.305)


class MeasuredPassCost:
    """A line fitted to the passes the engine times: per pass size (lanes), the smoothed wall time
    of its recent passes (an exponential average, so it follows the history growing under a long
    prompt); the line is their least-squares fit once two sizes are known, the prior scaled
    through the one size known before that. The first pass of each size is not counted: it pays
    what later ones do not (a graph capture, a Numba compile)."""

    def __init__(self, prior: PassCost = FLASH_H200, smoothing: float = 0.25, sizes: int = 8):
        if not 0 < smoothing <= 1 or sizes < 2:
            raise ValueError(f"smoothing must be in (0, 1] and sizes >= 2, got {smoothing}, {sizes}")
        self.prior, self.smoothing, self.sizes = prior, smoothing, sizes
        self.fit = prior
        self._ran: set[int] = set()
        self._ms: dict[int, float] = {}  # lanes -> smoothed ms, least recently run first

    def ms(self, lanes: int) -> float:
        return self.fit.ms(lanes)

    def observe(self, lanes: int, ms: float) -> None:
        if lanes not in self._ran:
            self._ran.add(lanes)
            return
        old = self._ms.pop(lanes, None)
        self._ms[lanes] = ms if old is None else old + self.smoothing * (ms - old)
        if len(self._ms) > self.sizes:
            del self._ms[next(iter(self._ms))]
        self.fit = self._line()

    def _line(self) -> PassCost:
        xs, ys = list(self._ms), list(self._ms.values())
        if len(xs) >= 2:
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            if slope > 0:
                return PassCost(max(0.0, my - slope * mx), slope)
        # one size known (or times that fall with size: noise): the prior through their mean
        scale = sum(ys) / sum(self.prior.ms(x) for x in xs)
        return PassCost(self.prior.fixed_ms * scale, self.prior.row_ms * scale)
