"""OpenAI-compatible HTTP serving of a DS4 model: `python -m ds4ref.serve`.

build_state() wires model -> backend -> SeqEngine -> Scheduler -> Runner;
create_app() puts the HTTP API on top. Tests use both directly.
"""
from __future__ import annotations

import os
from typing import Optional

from ..backend import DECODE_LANES
from ..scheduler.pass_cost import DEFAULT_MAX_ITL_MS, LONG_PASS_ROWS
from ..gguf.version import chat_version


def build_state(model_path: Optional[str] = None, backend: str = "numpy", max_concurrency: int = 16,
                kv_pool_tokens: Optional[int] = None, max_context: Optional[int] = None,
                max_queue: Optional[int] = None, served_model_name: Optional[str] = None,
                max_pending: int = 1024, stall_timeout: float = 30.0, prompt_quantum: Optional[int] = None,
                numerics: str = "official", api_key: Optional[str] = None,
                allowed_origins: tuple[str, ...] = (), memory_budget: Optional[int] = None,
                max_batched_rows: Optional[int] = None, prefix_cache: bool = True, mtp: Optional[str] = None,
                speculative_tokens: int = 0, max_itl_ms: Optional[float] = DEFAULT_MAX_ITL_MS,
                dspark: Optional[str] = None):
    """A ServerState with a stopped Runner (the app's lifespan starts it). prompt_quantum and
    max_itl_ms are the Scheduler's (None: chunked prefill over the whole pass, no inter-token
    budget); max_batched_rows sizes the backend's largest pass and the Scheduler's (None:
    pass_rows' default); prefix_cache the SeqEngine's; mtp: a separate MTP GGUF for the model
    (ds4ref.load's `mtp`); speculative_tokens: drafts per round (0: off), from the model's MTP
    block, or from `dspark`, a DSpark draft GGUF (ds4ref.load's `dspark`), when given."""
    from ..model import from_file
    from ..paging.plan import summary
    from ..scheduler.scheduler import Scheduler
    from ..scheduler.seq_engine import SeqEngine
    from .app import ServerState
    from .metrics import Metrics
    from .runner import Runner

    model_file, plan = plan_start(model_path, backend, numerics, max_concurrency, kv_pool_tokens, max_context,
                                  max_batched_rows, prefix_cache, mtp, dspark)
    check_plan(plan, backend, memory_budget)  # before anything is allocated or uploaded
    model = from_file(model_file, backend=backend, numerics=numerics, mtp=mtp, dspark=dspark)
    context = plan.context
    if speculative_tokens and model.mtp is None and model.dspark is None:
        raise ValueError(f"--speculative-tokens {speculative_tokens} needs an MTP block: {model.path} carries "
                         f"none; give its MTP file with --mtp FILE (or, for DeepSeek-V4-Flash-0731, its DSpark "
                         f"draft with --dspark FILE)")
    rows = pass_rows(backend, model.config, max_batched_rows)
    device = model.make_backend(backend, max(rows, DECODE_LANES))
    if backend == "hip" and max_batched_rows is None:  # the default pass: as large as the device holds
        draft = model.dspark.weights if model.dspark is not None else "mtp" if model.mtp is not None else None
        fits = fitting_pass_rows(plan, device.rt.mem_info()[0], numerics, draft)
        if fits != rows:
            rows, plan = fits, hip_plan(plan, fits, numerics, draft)
            device = model.make_backend(backend, rows)
    engine = SeqEngine(device, model.config, max_concurrency=max_concurrency,
                       kv_pool_tokens=kv_pool_tokens, max_context=context, prefix_cache=prefix_cache,
                       speculative_tokens=speculative_tokens)
    scheduler = Scheduler(engine, max_queue=max_queue, prompt_quantum=prompt_quantum, max_batched_rows=rows,
                          max_itl_ms=max_itl_ms)
    runner = Runner(scheduler, max_pending=max_pending, stall_timeout=stall_timeout, metrics=Metrics())
    name = served_model_name or str(model.metadata.get("general.name", model.config.name))
    state = ServerState(runner=runner, tokenizer=model.tokenizer, model_name=name, max_context=context,
                        vocab_size=model.config.vocab_size, chat_version=chat_version(model.metadata),
                        pool_tokens=engine.pool.n_pages * engine.pool.page_tokens, api_key=api_key or None,
                        allowed_origins=tuple(allowed_origins))
    describe = getattr(engine.backend, "describe", None)
    beside = f"sized to a {max_itl_ms:g} ms inter-token budget" if max_itl_ms else "no inter-token budget"
    release = " (DeepSeek-V4-Flash-0731: its chat template's reasoning efforts)" if state.chat_version == "0731" else ""
    state.banner = (f"ds4ref serving {name!r}{release} from {model.path} on the {backend} backend"
                    f"{f' [{describe()}]' if describe else ''}: "
                    f"{max_concurrency} lanes, passes of up to {scheduler.max_batched_rows} rows "
                    f"(prompt chunks of up to {scheduler.prompt_quantum}; beside decoders, {beside}), "
                    f"{engine.pool.n_pages} KV pages of {engine.pool.page_tokens} tokens, context {context} tokens, "
                    f"max queue "
                    f"{'unbounded' if max_queue is None else max_queue}, prefix cache "
                    f"{'on' if engine.cache is not None else 'off'}, speculative decoding "
                    f"{f'{speculative_tokens} drafts a round' if speculative_tokens else 'off'}"
                    f"{' (DSpark)' if speculative_tokens and model.dspark is not None else ''}")
    state.plan = summary(plan)
    return state


def pass_rows(backend: str, config, max_batched_rows: Optional[int]) -> int:
    """The most rows of one pass when serving: --max-batched-rows, else LONG_PASS_ROWS (a lone
    prompt's pass) within the most the hip kernels run for this model (hip.launch.largest_pass)."""
    if backend != "hip":
        return LONG_PASS_ROWS if max_batched_rows is None else max_batched_rows
    from ..hip.launch import largest_pass
    most = largest_pass(config)
    if max_batched_rows is None:
        return min(LONG_PASS_ROWS, most)
    if max_batched_rows > most:
        raise ValueError(f"--max-batched-rows ({max_batched_rows}) must be at most {most}: the hip backend runs "
                         f"passes of up to {most} rows of a model of {config.n_expert} experts")
    return max_batched_rows


def plan_start(model_path: Optional[str], backend: str, numerics: str, max_concurrency: int,
               kv_pool_tokens: Optional[int], max_context: Optional[int], max_batched_rows: Optional[int] = None,
               prefix_cache: bool = True, mtp: Optional[str] = None, dspark: Optional[str] = None):
    """The opened model file (header only) and the memory plan of serving it with these
    flags; refuses bad flag combinations. Reads no tensor data and allocates nothing."""
    from ..gguf.file import open_gguf
    from ..paging.layout import kv_storage
    from ..paging.plan import make_plan, weight_bytes
    from ..gguf.tiny import default_model_path, packaged_mtp

    if not 1 <= max_concurrency <= DECODE_LANES:
        raise ValueError(f"--max-concurrency must be in 1..{DECODE_LANES}, got {max_concurrency}")
    if max_batched_rows is not None and max_batched_rows < max_concurrency:
        raise ValueError(f"--max-batched-rows ({max_batched_rows}) must be at least --max-concurrency "
                         f"({max_concurrency}): every decoding request needs its row in every pass")
    if kv_pool_tokens is not None and max_concurrency == 1:
        raise ValueError("--kv-pool-tokens needs --max-concurrency > 1: a single lane always gets "
                         "a pool for its whole context")
    model_file = open_gguf(model_path if model_path is not None else default_model_path())
    model_context = model_file.config.context_length
    if max_context is not None and not 1 < max_context <= model_context:
        raise ValueError(f"--max-context must be in 2..{model_context} (the model's context length), "
                         f"got {max_context}")
    # what SeqEngine will allocate: the same pool_pages, the backend's row storage (serving is float32);
    # an MTP block (in the file, or --mtp's) adds its weights and a window ring a lane (the numpy
    # backend keeps those rings in the working float)
    weights = weight_bytes(model_file)
    if mtp is None:
        mtp = packaged_mtp(model_file.path)
    if mtp is not None:  # the tensors it reads, not the copies of the model's llama.cpp's MTP file carries
        from ..gguf.mtp import separate_mtp
        weights += separate_mtp(mtp, model_file.config).stored_bytes()  # sizes only: a dry run reads no tensor
    has_mtp = mtp is not None or model_file.mtp_block is not None
    draft = "mtp" if has_mtp else None
    draft_config = None
    if dspark is not None:  # it drafts instead of the MTP block: its weights and a ring a stage a lane
        from ..gguf.dspark_file import load_dspark
        from ..hip.dspark import state_config
        draft = load_dspark(dspark, model_file)
        weights += draft.stored_bytes()
        # on hip a stage's ring holds the window and a block (hip/dspark.py)
        draft_config = state_config(draft.config, draft.dspark) if backend == "hip" else draft.config
        has_mtp = True
    storage = kv_storage(backend, numerics)
    plan = make_plan(model_file.config, weights, max_concurrency, max_context or model_context,
                     kv_pool_tokens, storage, prefix_cache=prefix_cache,
                     mtp_storage=(storage if backend == "hip" else "f32") if has_mtp else None,
                     draft_config=draft_config)
    if backend == "hip":
        plan = hip_plan(plan, max(pass_rows(backend, model_file.config, max_batched_rows), DECODE_LANES),
                        numerics, draft)
    return model_file, plan


def hip_plan(plan, rows: int, numerics: str, draft=None):
    """The plan with what HipBackend.configure allocates beside the state for a largest pass of
    `rows` rows and lanes of the plan's context (SeqEngine's max_context): the pass workspace and
    the draft module's device state: draft "mtp" (the MTP block), a DSpark draft's weights
    (gguf.dspark_file.DSparkWeights), or None."""
    from dataclasses import replace
    from ..gguf.mtp import mtp_config
    from ..hip import dspark as hip_dspark
    from ..hip import mtp as hip_mtp
    from ..hip.workspace import with_pass_workspace
    plan = with_pass_workspace(plan, rows, numerics)
    shape = (plan.lanes, plan.n_pages, plan.page_tokens, rows, plan.storage == "compact", plan.context)
    if draft == "mtp":
        plan = replace(plan, draft=hip_mtp.device_bytes(mtp_config(plan.config), *shape))
    elif draft is not None:
        plan = replace(plan, draft=hip_dspark.device_bytes(draft.config, draft.dspark, *shape))
    return plan


def fitting_pass_rows(plan, free: int, numerics: str, draft=None) -> int:
    """The largest pass, halving from plan.workspace_rows down to PREFILL_ROWS, whose state and
    workspace fit `free` device bytes as HipBackend.configure checks them (95%): the server's
    default must not refuse a start that smaller passes allow. PREFILL_ROWS when none fits
    (configure then refuses, naming the bytes)."""
    from ..backend import PREFILL_ROWS

    def fits(rows: int) -> bool:
        p = hip_plan(plan, rows, numerics, draft)
        return p.paged + p.slots + p.workspace + p.draft <= 0.95 * free

    rows = plan.workspace_rows
    while rows > PREFILL_ROWS and not fits(rows):
        rows //= 2
    return max(rows, min(PREFILL_ROWS, plan.workspace_rows))


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory(backend: str, memory_budget: Optional[int]) -> tuple[Optional[int], str]:
    """(bytes the plan must fit, or None when the backend checks for itself; how to say it)."""
    from ..paging.plan import size
    if memory_budget is not None:
        return memory_budget, f"{size(memory_budget)} (--memory-budget)"
    if backend == "numpy":
        have = host_memory_bytes()
        return have, f"{size(have)} host RAM"
    return None, "device memory: checked at start"


def check_plan(plan, backend: str, memory_budget: Optional[int]) -> None:
    """Refuse, before allocating, a plan that cannot fit (a 2^40 context would otherwise end
    in a bare MemoryError); the message names the keys and flags that size it."""
    from ..paging.plan import check_fits
    available, _ = available_memory(backend, memory_budget)
    if available is not None:
        check_fits(plan, available, "--memory-budget is" if memory_budget is not None else "this machine has")


def dry_run(model_path: Optional[str], backend: str, numerics: str, max_concurrency: int,
            kv_pool_tokens: Optional[int], max_context: Optional[int],
            memory_budget: Optional[int], max_batched_rows: Optional[int] = None,
            prefix_cache: bool = True, mtp: Optional[str] = None,
            dspark: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(the plan's table, why it does not fit or None): what --dry-run prints."""
    from ..paging.plan import PlanError, table
    model_file, plan = plan_start(model_path, backend, numerics, max_concurrency, kv_pool_tokens, max_context,
                                  max_batched_rows, prefix_cache, mtp, dspark)
    _, available = available_memory(backend, memory_budget)
    text = (f"ds4ref memory plan for {model_file.config.name!r} ({model_file.path}): {backend} backend, "
            f"{numerics} numerics, {plan.lanes} lanes, context {plan.context} tokens\n" + table(plan, available)
            + "\n" + prefix_cache_line(plan, prefix_cache))
    try:
        check_plan(plan, backend, memory_budget)
    except PlanError as e:
        return text, str(e)
    return text, None


def prefix_cache_line(plan, on: bool) -> str:
    """The dry run's word on the prefix cache: its pages are the pool's, its snapshots a table row."""
    if not on:
        return "prefix cache    off (--no-prefix-cache)"
    return (f"prefix cache    on: cached prefixes live in the paged history's {plan.n_pages} pages (the KV page "
            f"pool, shared with running requests); a page no request holds stays cached until a request needs "
            f"it; its snapshots of a lane's unpaged state are the 'prefix cache' row")


def create_app(state):
    from .app import create_app as _create
    return _create(state)
