"""python -m ds4ref.cli.bench: load a running server with concurrent greedy streams.

For each concurrency level C: one warm-up round of C short requests, then
`repeats` rounds of C simultaneous streaming requests (greedy, ignore_eos so
every request runs to max_tokens). Reported per level:

  tok/s      completion tokens of all requests / wall time of the rounds
  TTFT       request sent -> first text chunk (p50, p99 over requests)
  ITL        gap between consecutive text chunks (p50, p99 over all gaps)
  errors     non-200 answers, error events, or a finish other than "length"

With --turns N it replays multi-turn chats instead (ds4ref/cli/bench_turns.py): TTFT
and the server's cached prompt tokens per turn; --compare-prefix-cache starts two
servers itself, with the prefix cache and without, and prints both side by side.

With --speculative-tokens K it measures speculative decoding in process instead
(ds4ref/cli/bench_spec.py): speed-up against acceptance with controlled drafts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional
from ..console import HelpFormatter
from .bench_util import WORDS, StreamError, failure, ms, percentile, stream_chunks, text_table

import httpx

def short_ragged_prompts(n: int, seed: int = 0) -> list[str]:
    """n disjoint prompts (each opens with its own number, so no two share a
    prefix) of ragged lengths, 2 to 12 words."""
    rng = random.Random(seed)
    return [f"Prompt {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for i in range(n)]


def file_prompts(path: str) -> list[str]:
    """One prompt per non-empty line; a line that is a JSON string is decoded (for newlines)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.strip():
                out.append(json.loads(line) if line.startswith('"') else line)
    if not out:
        raise SystemExit(f"{path}: no prompts")
    return out


@dataclass
class Sample:
    ttft: Optional[float] = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: Optional[str] = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    tok_per_s: float
    ttft_p50: Optional[float]
    ttft_p99: Optional[float]
    itl_p50: Optional[float]
    itl_p99: Optional[float]
    errors: int


async def one_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sample = Sample()
    t0 = last = time.perf_counter()
    finish = None
    try:
        async for chunk in stream_chunks(client, url, "/v1/completions", body):
            if chunk.get("usage"):
                sample.tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
                if choice.get("text"):
                    now = time.perf_counter()
                    if sample.ttft is None:
                        sample.ttft = now - t0
                    else:
                        sample.gaps.append(now - last)
                    last = now
    except (StreamError, httpx.HTTPError) as e:
        sample.error = failure(e)
        return sample
    if finish != "length":
        sample.error = f"finish_reason {finish!r}, expected 'length'"
    return sample


async def run_round(client, url, model, prompts, max_tokens, progress) -> tuple[list[Sample], float]:
    async def tracked(p: str) -> Sample:
        s = await one_stream(client, url, model, p, max_tokens)
        if progress is not None:
            progress.update(1)
        return s

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(tracked(p) for p in prompts))
    return list(samples), time.perf_counter() - t0


async def bench(url: str, levels: list[int], max_tokens: int, prompts: list[str], repeats: int,
                warmup_tokens: int, timeout: float, show_progress: bool) -> list[LevelResult]:
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        models = (await client.get(url + "/v1/models")).json()
        model = models["data"][0]["id"]
        progress = None
        if show_progress:
            from tqdm import tqdm
            progress = tqdm(total=sum(levels) * repeats, unit="req", file=sys.stderr)
        results = []
        cursor = 0
        for c in levels:
            def take(k: int) -> list[str]:
                nonlocal cursor
                batch = [prompts[(cursor + i) % len(prompts)] for i in range(k)]
                cursor += k
                return batch

            if warmup_tokens:
                await run_round(client, url, model, take(c), warmup_tokens, None)
            samples, seconds = [], 0.0
            for _ in range(repeats):
                s, dt = await run_round(client, url, model, take(c), max_tokens, progress)
                samples += s
                seconds += dt
            tokens = sum(s.tokens for s in samples)
            ttfts = [s.ttft for s in samples if s.ttft is not None and s.error is None]
            gaps = [g for s in samples if s.error is None for g in s.gaps]
            results.append(LevelResult(c, len(samples), tokens, seconds, tokens / seconds if seconds else 0.0,
                                       percentile(ttfts, 50), percentile(ttfts, 99), percentile(gaps, 50),
                                       percentile(gaps, 99), sum(s.error is not None for s in samples)))
            for s in samples:
                if s.error:
                    print(f"C={c}: {s.error}", file=sys.stderr)
        if progress is not None:
            progress.close()
        return results


def table(results: list[LevelResult]) -> str:
    columns = [("C", 3), ("reqs", 5), ("tokens", 7), ("tok/s", 8), ("TTFT p50", 9), ("TTFT p99", 9),
               ("ITL p50", 8), ("ITL p99", 8), ("errors", 6)]
    rows = [[str(r.concurrency), str(r.requests), str(r.tokens), f"{r.tok_per_s:.1f}", ms(r.ttft_p50),
             ms(r.ttft_p99), ms(r.itl_p50), ms(r.itl_p99), str(r.errors)] for r in results]
    return text_table(columns, rows, "(TTFT and ITL in milliseconds)")


def base_url(url: str) -> str:
    """The server root of what a user pastes: OpenAI clients are configured with .../v1."""
    url = url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--speculative-tokens") for a in argv):  # in process, no server: bench_spec.py
        from .bench_spec import main as spec_main
        return spec_main(argv)
    p = argparse.ArgumentParser(prog="python -m ds4ref.cli.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL, with or without /v1")
    p.add_argument("--concurrency", type=parse_levels, default=[1, 4, 8, 16], help="e.g. 1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--prompts", default="short-ragged", help="'short-ragged' or a file with one prompt per line")
    p.add_argument("--repeats", type=int, default=1, help="measured rounds per level")
    p.add_argument("--warmup-tokens", type=int, default=8, help="max_tokens of the warm-up round (0 = none)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    turns = p.add_argument_group("multi-turn chats (--turns)")
    turns.add_argument("--turns", type=at_least_one, default=None,
                       help="replay chats of this many turns instead of the load test")
    turns.add_argument("--conversations", type=at_least_one, default=4, help="chats measured (p50 over them)")
    turns.add_argument("--turn-tokens", type=at_least_one, default=200, help="about how long each new user message is")
    turns.add_argument("--first-turn-tokens", type=at_least_one, default=None,
                       help="about how long the first user message is (default: --turn-tokens)")
    turns.add_argument("--compare-prefix-cache", action="store_true",
                       help="start python -m ds4ref.serve on loopback ports, with the prefix cache and then "
                            "without (--no-prefix-cache), and print both (--url is not used)")
    turns.add_argument("--serve-args", default="",
                       help="flags for the servers --compare-prefix-cache starts, e.g. '--model M.gguf'")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.repeats < 1:
        p.error("--max-tokens and --repeats must be >= 1")
    if args.turns is not None:
        return _main_turns(p, args)
    if args.compare_prefix_cache or args.serve_args:
        p.error("--compare-prefix-cache and --serve-args need --turns")
    prompts = (short_ragged_prompts(max(args.concurrency) * (args.repeats + 1) * len(args.concurrency))
               if args.prompts == "short-ragged" else file_prompts(args.prompts))
    url = base_url(args.url)
    try:
        results = asyncio.run(bench(url, args.concurrency, args.max_tokens, prompts, args.repeats,
                                    args.warmup_tokens, args.timeout, not args.no_progress))
    except httpx.HTTPError as e:
        print(f"ds4ref.cli.bench: cannot reach {url}: {e}", file=sys.stderr)
        return 2
    print(json.dumps([asdict(r) for r in results], indent=2) if args.json else table(results))
    return 1 if any(r.errors for r in results) else 0


def _main_turns(p: argparse.ArgumentParser, args) -> int:
    import shlex

    from . import bench_turns as bt

    load_test_only = [f"--{n.replace('_', '-')}" for n in ("concurrency", "prompts", "repeats", "warmup_tokens")
                      if getattr(args, n) != p.get_default(n)]
    if load_test_only:
        p.error(f"{', '.join(load_test_only)} belong to the load test, not to --turns")
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as e:
        p.error(f"--serve-args: {e}")
    why = bt.check_serve_args(serve_args)
    if why:
        p.error(why)
    if serve_args and not args.compare_prefix_cache:
        p.error("--serve-args needs --compare-prefix-cache (otherwise the server is yours to start)")
    shape = (args.turns, args.conversations, args.first_turn_tokens or args.turn_tokens, args.turn_tokens,
             args.max_tokens, args.timeout)

    def measure(url: str) -> list:
        return asyncio.run(bt.bench_turns(url, *shape))

    try:
        if args.compare_prefix_cache:
            runs = {}
            for cache in (True, False):
                with bt.spawned_server(serve_args, cache) as url:
                    print(f"prefix cache {'on' if cache else 'off'}: {url}", file=sys.stderr, flush=True)
                    runs[cache] = measure(url)
            results = {"prefix_cache_on": runs[True], "prefix_cache_off": runs[False]}
            text = bt.compare_table(runs[True], runs[False])
        else:
            url = base_url(args.url)
            results = {"turns": measure(url)}
            text = bt.turns_table(results["turns"])
    except httpx.HTTPError as e:
        print(f"ds4ref.cli.bench: cannot reach the server: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a server that would not start
        print(f"ds4ref.cli.bench: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: [asdict(r) for r in v] for k, v in results.items()}, indent=2) if args.json else text)
    return 1 if any(r.errors for v in results.values() for r in v) else 0


if __name__ == "__main__":
    sys.exit(main())
