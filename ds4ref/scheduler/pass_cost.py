"""What a pass costs, so the Scheduler can size a prompt's share of it (docs/scheduler.md).

A pass's wall time is modelled as `fixed_ms + row_ms * lanes`, where lanes are the rows the
backend actually runs (HipBackend pads a pass to its capacity bucket). Beside decoders, the
Scheduler gives prompts the most rows whose pass this model predicts within the inter-token
budget (`max_itl_ms`): Sarathi-Serve's stall-free batching, with the token budget derived from
the latency target instead of set by hand.

`PassCost` is a given model: it learns nothing, so a schedule under it depends only on the
requests (tests inject one). `MeasuredPassCost` starts from a prior and follows the passes the
engine times.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..backend import DECODE_LANES

# a lone prompt's pass when serving (the hip backend's at most hip.launch.largest_pass, 4096): at
# Flash's top-6 of 256 experts each expert holds about 48 rows, where a 256-row pass gives it 6
LONG_PASS_ROWS = 2048
DEFAULT_MAX_ITL_MS = 150.0  # docs/scheduler.md "How passes are sized" says why (measured on the H200)
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
    """The cost of the passes the engine times. Per pass size (lanes) it keeps the smoothed wall
    time of its recent passes (an exponential average, so it follows the history growing under a
    long prompt). Between two sizes it has timed it predicts the line through them (a fixed cost
    and a per-row cost of its own: a pass's cost need not be one line from 16 to 2048 rows, and
    the sizes near the budget are the ones timed most); below the smallest, the line of the
    smallest two; past the largest, a row costs at least that size's average row, so a size
    never timed is not chosen on a guess that it is cheap. The times are taken non-decreasing
    in size, so the prediction is. Before it has timed two sizes, the prior scaled through the
    one it has. The first pass of each size is not counted: it pays what later ones do not (a
    graph capture, a compile)."""

    def __init__(self, prior: PassCost = FLASH_H200, smoothing: float = 0.25, sizes: int = 8):
        if not 0 < smoothing <= 1 or sizes < 2:
            raise ValueError(f"smoothing must be in (0, 1] and sizes >= 2, got {smoothing}, {sizes}")
        self.prior, self.smoothing, self.sizes = prior, smoothing, sizes
        self._ran: set[int] = set()
        self._ms: dict[int, float] = {}  # lanes -> smoothed ms, least recently run first
        self._knots: list[tuple[int, float]] = []  # (lanes, ms) by lanes, ms non-decreasing
        self._scaled = prior

    @property
    def knots(self) -> list[tuple[int, float]]:
        """The sizes timed and their smoothed times, as the prediction uses them."""
        return list(self._knots)

    def ms(self, lanes: int) -> float:
        k = self._knots
        if len(k) < 2:
            return self._scaled.ms(lanes)
        i = next((j for j in range(1, len(k)) if lanes <= k[j][0]), None)
        if i is None:
            (x0, y0), (x1, y1) = k[-2], k[-1]
            return y1 + max((y1 - y0) / (x1 - x0), y1 / x1) * (lanes - x1)
        (x0, y0), (x1, y1) = k[i - 1], k[i]
        return max(0.0, y0 + (y1 - y0) * (lanes - x0) / (x1 - x0))

    def observe(self, lanes: int, ms: float) -> None:
        if lanes not in self._ran:
            self._ran.add(lanes)
            return
        old = self._ms.pop(lanes, None)
        self._ms[lanes] = ms if old is None else old + self.smoothing * (ms - old)
        if len(self._ms) > self.sizes:
            del self._ms[next(iter(self._ms))]
        knots, most = [], 0.0
        for x in sorted(self._ms):
            most = max(most, self._ms[x])
            knots.append((x, most))
        self._knots = knots
        if len(knots) == 1:
            scale = most / self.prior.ms(knots[0][0])
            self._scaled = PassCost(self.prior.fixed_ms * scale, self.prior.row_ms * scale)
