"""Prometheus text exposition (format 0.0.4), written by hand: a few counters,
histograms and the scheduler's gauges, safe to update from the runner thread."""
from __future__ import annotations

import bisect
import threading
from typing import Iterable, Mapping

PREFIX = "ds4"
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _fmt(v: float) -> str:
    return repr(float(v)) if v != int(v) else str(int(v))


class Counter:
    def __init__(self, name: str, help: str, label: str | None = None) -> None:
        self.name, self.help, self.label = name, help, label
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def inc(self, label_value: str = "", by: float = 1.0) -> None:
        with self._lock:
            self._values[label_value] = self._values.get(label_value, 0.0) + by

    def value(self, label_value: str = "") -> float:
        with self._lock:
            return self._values.get(label_value, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            values = dict(self._values) or ({} if self.label else {"": 0.0})
        for lv, v in sorted(values.items()):
            labels = f'{{{self.label}="{lv}"}}' if self.label else ""
            lines.append(f"{self.name}{labels} {_fmt(v)}")
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: Iterable[float]) -> None:
        self.name, self.help = name, help
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._sum += seconds

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = 0
        for le, c in zip(self.buckets + (float("inf"),), counts):
            cumulative += c
            le_s = "+Inf" if le == float("inf") else _fmt(le)
            lines.append(f'{self.name}_bucket{{le="{le_s}"}} {cumulative}')
        lines += [f"{self.name}_sum {_fmt(total)}", f"{self.name}_count {cumulative}"]
        return lines


# scheduler stats key -> (metric name, help); keys the scheduler does not report are skipped
GAUGES = {
    "running": ("requests_running", "Requests holding a decode slot."),
    "waiting": ("requests_waiting", "Requests queued for a slot."),
    "pages_used": ("kv_pages_used", "KV pool pages in use."),
    "pages_free": ("kv_pages_free", "KV pool pages free."),
    "prefix_cached_pages": ("prefix_cache_pages", "KV pool pages the prefix cache holds (shared or evictable)."),
    "prefix_snapshots": ("prefix_cache_snapshots", "Snapshots of a lane's unpaged state the prefix cache holds."),
    "prefix_tails": ("prefix_cache_tails", "Partial last pages (with their snapshots) the prefix cache holds."),
}


# scheduler stats key -> (counter name, help): running totals the scheduler keeps itself
STAT_COUNTERS = {
    "preemptions": ("preemptions_total", "Sequences preempted because the KV pool was full (recomputed later)."),
    "prefix_hits": ("prefix_cache_hits_total", "Admissions that reused cached prefix pages."),
    "prefix_misses": ("prefix_cache_misses_total", "Admissions that found no cached prefix."),
    "prefix_cached_tokens": ("prefix_cache_cached_tokens_total", "Prompt tokens served from the prefix cache."),
    "prefix_evictions": ("prefix_cache_evictions_total", "Cached prefix pages evicted to make room."),
    "prefix_tail_hits": ("prefix_cache_tail_hits_total", "Admissions that resumed from a cached partial page."),
    "spec_proposed": ("spec_draft_tokens_total", "Draft tokens speculative rounds proposed."),
    "spec_accepted": ("spec_accepted_tokens_total", "Draft tokens the model's own choices confirmed."),
    "spec_rounds": ("spec_rounds_total", "Speculative rounds (passes in which a sequence verified drafts)."),
    "spec_off": ("spec_auto_off_total", "Sequences that stopped drafting because too few drafts were accepted."),
}


class Metrics:
    def __init__(self) -> None:
        p = PREFIX
        self.tokens_generated = Counter(f"{p}_tokens_generated_total", "Tokens generated (all requests).")
        self.prompt_tokens = Counter(f"{p}_prompt_tokens_total", "Prompt tokens of accepted requests.")
        self.requests = Counter(f"{p}_requests_total", "HTTP generation requests by outcome.", "outcome")
        self.finished = Counter(f"{p}_requests_finished_total", "Scheduler finish events by reason.", "reason")
        self.slow_client_cancels = Counter(f"{p}_slow_client_cancels_total",
                                           "Requests cancelled because the client stopped reading.")
        self.step_failures = Counter(f"{p}_step_failures_total", "Scheduler steps that raised.")
        self.http_errors = Counter(f"{p}_http_errors_total", "Error responses by HTTP status.", "status")
        self.step_seconds = Histogram(f"{p}_step_seconds", "Wall time of one scheduler step.", STEP_BUCKETS)
        self.ttft_seconds = Histogram(f"{p}_time_to_first_token_seconds",
                                      "From request arrival to its first token.", TTFT_BUCKETS)

    def render(self, stats: Mapping[str, float]) -> str:
        lines: list[str] = []
        for key, (name, help) in GAUGES.items():
            if key in stats:
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {help}", f"# TYPE {full} gauge", f"{full} {_fmt(stats[key])}"]
        for key, (name, help) in STAT_COUNTERS.items():
            if key in stats:
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {help}", f"# TYPE {full} counter", f"{full} {_fmt(stats[key])}"]
        for m in (self.tokens_generated, self.prompt_tokens, self.requests, self.finished,
                  self.slow_client_cancels, self.step_failures, self.http_errors, self.step_seconds,
                  self.ttft_seconds):
            lines += m.render()
        return "\n".join(lines) + "\n"
