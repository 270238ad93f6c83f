"""python -m ds4ref.serve: the OpenAI-compatible server (flags in docs/serving.md)."""
from __future__ import annotations

import argparse
import errno
import logging
import re
import socket
import sys
from ..console import HelpFormatter
from ..settings import getenv

from ..hip.launch import LARGEST_PASS
from ..scheduler.pass_cost import DEFAULT_MAX_ITL_MS, LONG_PASS_ROWS
from . import DECODE_LANES
from .connections import HEADER_TIMEOUT_S


def _int_in(text: str, lo: int, hi: int | None, why: str = "") -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < lo or (hi is not None and n > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise argparse.ArgumentTypeError(f"must be {bound}{why}, got {n}")
    return n


def lanes(text: str) -> int:
    return _int_in(text, 1, DECODE_LANES, f" (one pass serves at most {DECODE_LANES} decoding requests)")


def positive(text: str) -> int:
    return _int_in(text, 1, None)


def non_negative(text: str) -> int:
    return _int_in(text, 0, None)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def non_negative_number(unit: str):
    """An argparse type: a finite number >= 0 of `unit`."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        if not x >= 0 or x == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
        return x
    return parse


def byte_size(text: str) -> int:
    """Bytes, with an optional binary unit: 1073741824, 512M, 128G, 1.5GiB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 128G, 512M or a number of bytes, got {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds4ref.serve", description="Serve a DS4 model over an "
                                "OpenAI-compatible HTTP API.",
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded tiny model)")
    p.add_argument("--mtp", default=None, metavar="FILE",
                   help="the MTP block of --model, a separate GGUF: llama.cpp's MTP file (its converter's "
                        "--mtp, ds4ref's) or antirez's (mtp.0.*); the embedded model's ships beside it")
    p.add_argument("--dspark", default=None, metavar="FILE",
                   help="a DSpark draft GGUF for --model (llama.cpp's dflash file or antirez's DSpark support "
                        "file): --speculative-tokens K (K <= its block size) then drafts with it")
    p.add_argument("--backend", choices=("numpy", "hip"), default="numpy",
                   help="numpy: the exact reference; hip: the GPU fast path")
    p.add_argument("--numerics", choices=("official", "plain"), default="official",
                   help="FP8/FP4 simulation on (official) or off (plain)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 for remote clients)")
    p.add_argument("--port", type=int, default=8000, help="listen port")
    p.add_argument("--max-concurrency", type=lanes, default=16, help=f"decode lanes, 1..{DECODE_LANES}")
    p.add_argument("--kv-pool-tokens", type=positive, default=None,
                   help="size of the shared KV page pool in tokens (needs --max-concurrency > 1; "
                        "default: every lane can reach the full context)")
    p.add_argument("--max-context", type=positive, default=None,
                   help="per-request context limit, prompt plus output (default: the model's)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="turn off the exact prefix cache (on by default: a prompt that begins with whole KV "
                        "pages of an earlier or running request reuses their state; logits are bitwise the same)")
    p.add_argument("--speculative-tokens", type=non_negative, default=0, metavar="K",
                   help="speculative decoding: the MTP block (or --dspark's draft) drafts K tokens per round "
                        "and one pass verifies them; output is bitwise that of plain decoding, a sequence whose "
                        "drafts are rarely accepted stops drafting (needs an MTP block or --dspark; default 0 = off)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the memory plan (weights, paged KV history, per-slot state) and exit: 0 if it "
                        "fits, 2 if not; reads no tensor data, allocates nothing, binds no port")
    p.add_argument("--memory-budget", type=byte_size, default=None,
                   help="bytes the plan must fit, e.g. 128G (default: host RAM for numpy; the hip backend "
                        "checks device memory at start)")
    p.add_argument("--max-queue", type=non_negative, default=None,
                   help="requests allowed to wait for a lane; more get 503 (default: unbounded)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: general.name)")
    p.add_argument("--max-batched-rows", type=positive, default=None,
                   help="most rows of one pass, decode rows included (vLLM's max_num_batched_tokens): the pass a "
                        "long prompt runs in while no request decodes, and the backend's largest pass (the hip "
                        "backend's workspace scales with it); at least --max-concurrency (default: "
                        f"{LONG_PASS_ROWS}, for hip halved until the device holds it; hip runs passes of up to "
                        f"{LARGEST_PASS} rows)")
    p.add_argument("--max-itl-ms", type=non_negative_number("milliseconds"), default=DEFAULT_MAX_ITL_MS,
                   help="inter-token budget: a pass with decoding requests gets the prompt rows whose pass the "
                        "engine's measured cost model predicts within this many ms (at least 16 rows, so prompts "
                        "always advance); 0 = no budget, prompts take every row the decoders leave. Tokens are "
                        "identical either way")
    p.add_argument("--prompt-quantum", type=positive, default=None,
                   help="prompt rows a prefilling request may take per pass (default: the whole pass, chunked "
                        "prefill; 1 = upstream's exact mode). Tokens are identical either way")
    p.add_argument("--max-pending-events", type=positive, default=1024,
                   help="unread events a client may fall behind before its request is cancelled")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds a client may leave output unread before its request is cancelled (0 = never)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds to let open requests finish after SIGTERM/SIGINT")
    p.add_argument("--header-timeout", type=non_negative_number("seconds"), default=HEADER_TIMEOUT_S,
                   help="seconds a client may take to send a request's line and headers before its connection "
                        "is closed (slowloris; 0 = never)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level")
    p.add_argument("--api-key", default=getenv("DS4REF_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every path but /health and /metrics "
                        "(default: $DS4REF_API_KEY, else open)")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated CORS origins allowed to call the API from a browser ('*' = any; "
                        "default: none)")
    return p


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made before anything is printed: a busy port is one error line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they
    # are TCP, and accepted connections inherit it. With Nagle on, a stream's second small write
    # waits for the client's delayed ACK (~40 ms): every SSE response's first text arrived that late.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise OSError(f"address {host}:{port} {why}") from None
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from . import build_state, create_app
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    if args.dry_run:
        return _dry_run(args)
    try:
        sock = bind(args.host, args.port)
        state = build_state(args.model, args.backend, args.max_concurrency, args.kv_pool_tokens,
                            args.max_context, args.max_queue, args.served_model_name,
                            args.max_pending_events, args.stall_timeout, args.prompt_quantum, args.numerics,
                            api_key=args.api_key, allowed_origins=origins, memory_budget=args.memory_budget,
                            max_batched_rows=args.max_batched_rows, prefix_cache=args.prefix_cache,
                            mtp=args.mtp, speculative_tokens=args.speculative_tokens,
                            max_itl_ms=args.max_itl_ms or None, dspark=args.dspark)
    except Exception as e:  # a busy port, a bad flag combination, a missing GPU, an unreadable file
        print(f"ds4ref.serve: error: {str(e) or type(e).__name__}", file=sys.stderr)  # MemoryError() is ''
        return 2
    _warm_up(state, args.backend)
    print(f"{state.banner}; listening on http://{args.host}:{args.port}\n{state.plan}", flush=True)
    from .shutdown import serve
    serve(create_app(state), state.runner, sock, args.log_level, args.shutdown_timeout, args.header_timeout)
    return 0


def _warm_up(state, backend: str) -> None:
    """Before listening, what a request would otherwise pay the first time: on the numpy backend
    every Numba kernel a request can reach, compiled (first start after an install) or loaded
    (reference/warmup.py), each compile reported, now and for the rest of the process; on both
    backends llguidance's matcher tokenizer, built once per vocabulary for structured output."""
    from ..reference.warmup import report_compiles, warm_up
    from .structured import warm_structured
    report = report_compiles(lambda line: print(line, flush=True))
    if backend == "numpy":
        engine = state.runner.scheduler.engine
        mtp = engine.backend.mtp if engine.speculative_tokens and engine.backend.dspark is None else None
        seconds = warm_up(engine.backend.model, mtp,
                          state.runner.scheduler.max_batched_rows)
        if report.compiled:
            print(f"numba: {len(report.compiled)} kernels ready in {seconds:.1f} s", flush=True)
    warm_structured(state.tokenizer)


def _dry_run(args) -> int:
    from . import dry_run
    try:
        text, refusal = dry_run(args.model, args.backend, args.numerics, args.max_concurrency, args.kv_pool_tokens,
                                args.max_context, args.memory_budget, args.max_batched_rows, args.prefix_cache,
                                args.mtp, args.dspark)
    except Exception as e:  # a bad flag combination, an unreadable file
        print(f"ds4ref.serve: error: {str(e) or type(e).__name__}", file=sys.stderr)
        return 2
    print(text, flush=True)
    if refusal:
        print(f"ds4ref.serve: error: {refusal}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
