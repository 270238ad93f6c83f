"""OpenAI-compatible HTTP serving of a DS4 model: `python -m ds4ref.serve`.

build_state() wires model -> backend -> SeqEngine -> Scheduler -> Runner;
create_app() puts the HTTP API on top. Tests use both directly.
"""
from __future__ import annotations

import os
from typing import Optional

MAX_LANES = 16


def build_state(model_path: Optional[str] = None, backend: str = "numpy", max_concurrency: int = 16,
                kv_pool_tokens: Optional[int] = None, max_context: Optional[int] = None,
                max_queue: Optional[int] = None, served_model_name: Optional[str] = None,
                max_pending: int = 1024, stall_timeout: float = 30.0, prompt_quantum: int = 1,
                numerics: str = "official", api_key: Optional[str] = None,
                allowed_origins: tuple[str, ...] = ()):
    """A ServerState with a stopped Runner (the app's lifespan starts it)."""
    import ds4ref
    from ..scheduler.scheduler import Scheduler
    from ..scheduler.seq_engine import SeqEngine
    from .app import ServerState
    from .metrics import Metrics
    from .runner import Runner

    if not 1 <= max_concurrency <= MAX_LANES:
        raise ValueError(f"--max-concurrency must be in 1..{MAX_LANES}, got {max_concurrency}")
    if kv_pool_tokens is not None and max_concurrency == 1:
        raise ValueError("--kv-pool-tokens needs --max-concurrency > 1: a single lane always gets "
                         "a pool for its whole context")
    model = ds4ref.load(model_path, backend=backend, numerics=numerics)
    model_context = model.config.context_length
    if max_context is not None and not 1 < max_context <= model_context:
        raise ValueError(f"--max-context must be in 2..{model_context} (the model's context length), "
                         f"got {max_context}")
    context = max_context or model_context
    if backend == "numpy":  # the hip backend checks device memory itself
        check_host_memory(model.config, max_concurrency, context, kv_pool_tokens, model.reference.dtype)
    engine = SeqEngine(model.make_backend(backend), model.config, max_concurrency=max_concurrency,
                       kv_pool_tokens=kv_pool_tokens, max_context=context)
    scheduler = Scheduler(engine, max_queue=max_queue, prompt_quantum=prompt_quantum)
    runner = Runner(scheduler, max_pending=max_pending, stall_timeout=stall_timeout, metrics=Metrics())
    name = served_model_name or str(model.metadata.get("general.name", model.config.name))
    state = ServerState(runner=runner, tokenizer=model.tokenizer, model_name=name, max_context=context,
                        vocab_size=model.config.vocab_size,
                        pool_tokens=engine.pool.n_pages * engine.pool.page_tokens, api_key=api_key or None,
                        allowed_origins=tuple(allowed_origins))
    describe = getattr(engine.backend, "describe", None)
    state.banner = (f"ds4ref serving {name!r} from {model.path} on the {backend} backend"
                    f"{f' [{describe()}]' if describe else ''}: "
                    f"{max_concurrency} lanes, {engine.pool.n_pages} KV pages of {engine.pool.page_tokens} "
                    f"tokens, context {context} tokens, max queue "
                    f"{'unbounded' if max_queue is None else max_queue}")
    return state


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 30):.1f} GiB" if n_bytes >= 1 << 30 else f"{n_bytes / (1 << 20):.1f} MiB"


def check_host_memory(config, lanes: int, context: int, kv_pool_tokens: Optional[int], dtype) -> None:
    """Refuse, before allocating, a KV state that cannot fit this machine's memory,
    naming the keys and flags that size it (a 2^40 context once ended in a bare
    MemoryError)."""
    import numpy as np
    from ..backend import PAGE_TOKENS
    from ..paging.layout import PageLayout
    from ..paging.pool import pool_pages

    layout, itemsize = PageLayout(config, PAGE_TOKENS), np.dtype(dtype).itemsize
    n_pages = pool_pages(lanes, context, kv_pool_tokens, PAGE_TOKENS)
    paged = n_pages * layout.page_elements() * itemsize
    windows = lanes * layout.slot_elements() * itemsize
    have = host_memory_bytes()
    if paged + windows > have:
        raise MemoryError(
            f"the KV state needs {_size(paged + windows)} but this machine has {_size(have)}: "
            f"{_size(paged)} of pages for {lanes} lanes x {context} tokens (deepseek4.context_length, "
            f"or --max-context / --kv-pool-tokens) and {_size(windows)} of per-lane state "
            f"(deepseek4.attention.sliding_window = {config.sliding_window}); lower --max-context, "
            f"--kv-pool-tokens or --max-concurrency")


def create_app(state):
    from .app import create_app as _create
    return _create(state)
