"""Multi-turn conversations against a server, as a chat client replays them (`bench --turns`).

Each conversation starts with a user message of about `first_tokens` tokens; every turn
sends the whole conversation so far, streams the reply (greedy, ignore_eos, so each reply
is max_tokens long), appends it and a new user message of about `turn_tokens` tokens.
Recorded per turn: TTFT (request sent -> first text), the prompt's tokens and the
`usage.prompt_tokens_details.cached_tokens` the server reports (None if it reports none).
Conversations run one after another, so a turn's TTFT is its prefill alone; each opens
with its own number, so no two share a page of prompt.

With `compare_prefix_cache` it starts `python -m ds4ref.serve` itself on a loopback
port, twice (the prefix cache on, then off: --no-prefix-cache), one at a time.
"""
from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import httpx

from .bench_util import WORDS, StreamError, failure, ms, percentile, stream_chunks, text_table

SERVER_START_S = 600.0  # the first start after an install compiles the Numba kernels


@dataclass
class TurnSample:
    ttft: Optional[float] = None
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    error: Optional[str] = None


@dataclass
class TurnResult:
    turn: int
    conversations: int
    prompt_tokens_p50: Optional[float]
    cached_tokens_p50: Optional[float]
    ttft_p50: Optional[float]
    errors: int


@dataclass
class Words:
    """User messages of about n tokens, from the server's own count of tokens per word."""
    tokens_per_word: float
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def message(self, n: int, head: str = "") -> str:
        k = max(1, round(n / self.tokens_per_word))
        return head + " ".join(self.rng.choice(WORDS) for _ in range(k))


async def tokens_per_word(client: httpx.AsyncClient, url: str, model: str) -> float:
    """From POST /tokenize (ds4ref's, vLLM's, llama.cpp's); 1.0 where the server has none."""
    sample = " ".join(WORDS * 4)
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        r = await client.post(url + "/tokenize", json={"model": model, "prompt": sample})
        if r.status_code == 200:
            return max(r.json()["count"] / (len(WORDS) * 4), 0.01)
    return 1.0


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
                   max_tokens: int) -> tuple[TurnSample, str]:
    """Stream one chat turn: (its sample, the reply's text)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sample, reply = TurnSample(), []
    t0 = time.perf_counter()
    try:
        async for chunk in stream_chunks(client, url, "/v1/chat/completions", body):
            usage = chunk.get("usage")
            if usage:
                sample.prompt_tokens = usage.get("prompt_tokens")
                sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if (delta.get("content") or delta.get("reasoning_content")) and sample.ttft is None:
                    sample.ttft = time.perf_counter() - t0
                reply.append(delta.get("content") or "")
    except (StreamError, httpx.HTTPError) as e:
        sample.error = failure(e)
        return sample, ""
    return sample, "".join(reply)


async def conversation(client: httpx.AsyncClient, url: str, model: str, words: Words, index: int, turns: int,
                       first_tokens: int, turn_tokens: int, max_tokens: int) -> list[TurnSample]:
    messages = [{"role": "user", "content": words.message(first_tokens, f"Conversation {index}: ")}]
    samples = []
    for _ in range(turns):
        sample, reply = await one_turn(client, url, model, messages, max_tokens)
        samples.append(sample)
        if sample.error:
            break
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": words.message(turn_tokens)}]
    return samples


async def bench_turns(url: str, turns: int, conversations: int, first_tokens: int, turn_tokens: int,
                      max_tokens: int, timeout: float, warmup: bool = True) -> list[TurnResult]:
    """TurnResults per turn, p50 over the conversations. The warm-up conversation (same shape,
    not recorded) compiles the prompt passes' kernels of each size before the measured ones."""
    async with httpx.AsyncClient(timeout=timeout) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        words = Words(await tokens_per_word(client, url, model))
        runs = []
        for i in range(conversations + warmup):
            samples = await conversation(client, url, model, words, i, turns, first_tokens, turn_tokens, max_tokens)
            if i or not warmup:
                runs.append(samples)
            print(f"conversation {i}{' (warm-up)' if warmup and not i else ''}: TTFT "
                  + ", ".join("-" if s.ttft is None else f"{s.ttft * 1000:.0f}" for s in samples) + " ms",
                  file=sys.stderr, flush=True)
    results = []
    for t in range(turns):
        got = [run[t] for run in runs if len(run) > t]
        ok = [s for s in got if s.error is None]
        for s in got:
            if s.error:
                print(f"turn {t + 1}: {s.error}", file=sys.stderr)

        def p50(values: list) -> Optional[float]:
            return percentile([v for v in values if v is not None], 50)

        results.append(TurnResult(t + 1, len(got), p50([s.prompt_tokens for s in ok]),
                                  p50([s.cached_tokens for s in ok]), p50([s.ttft for s in ok]),
                                  len(got) - len(ok)))
    return results


def _n(v: Optional[float], scale: float = 1.0, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v * scale, fmt)


def turns_table(results: list[TurnResult]) -> str:
    rows = [[str(r.turn), _n(r.prompt_tokens_p50), _n(r.cached_tokens_p50), ms(r.ttft_p50), str(r.errors)]
            for r in results]
    return text_table([("turn", 4), ("prompt", 7), ("cached", 7), ("TTFT p50", 9), ("errors", 6)], rows,
                      "(prompt and cached: tokens, p50; TTFT in milliseconds)")


def compare_table(on: list[TurnResult], off: list[TurnResult]) -> str:
    rows = []
    for a, b in zip(on, off):
        ratio = b.ttft_p50 / a.ttft_p50 if a.ttft_p50 and b.ttft_p50 else None
        rows.append([str(a.turn), _n(a.prompt_tokens_p50), _n(a.cached_tokens_p50), ms(a.ttft_p50),
                     ms(b.ttft_p50), "-" if ratio is None else f"{ratio:.1f}x"])
    return text_table([("turn", 4), ("prompt", 7), ("cached", 7), ("TTFT cache on", 14), ("TTFT cache off", 15),
                       ("off/on", 7)], rows, "(prompt and cached: tokens, p50, cache on; TTFT p50 in milliseconds)")


# ---- starting the servers for --compare-prefix-cache -------------------------------------------------

FORBIDDEN_SERVE_ARGS = ("--host", "--port", "--no-prefix-cache", "--dry-run", "--api-key")


def check_serve_args(args: list[str]) -> Optional[str]:
    """Why these `python -m ds4ref.serve` flags cannot be used here, or None."""
    for a in args:
        name = a.split("=", 1)[0]
        if name in FORBIDDEN_SERVE_ARGS:
            return f"--serve-args must not set {name}: the benchmark picks it (loopback ports, cache on and off)"
    return None


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawned_server(serve_args: list[str], prefix_cache: bool, start_timeout: float = SERVER_START_S
                   ) -> Iterator[str]:
    """A `python -m ds4ref.serve` on a free loopback port, its URL; stopped (SIGTERM) on exit."""
    port = _free_loopback_port()
    cmd = [sys.executable, "-m", "ds4ref.serve", "--host", "127.0.0.1", "--port", str(port), "--log-level",
           "warning", *serve_args, *([] if prefix_cache else ["--no-prefix-cache"])]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + start_timeout
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = "".join(log.readlines()[-10:]).rstrip()
                    why = f"exited with {proc.returncode}" if proc.poll() is not None else "did not start in time"
                    raise RuntimeError(f"{' '.join(cmd[1:])} {why}:\n{tail}")
                time.sleep(0.2)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
