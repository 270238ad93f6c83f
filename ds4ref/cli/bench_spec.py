"""python -m ds4ref.cli.bench --speculative-tokens K: speculative decoding's speed-up against
its acceptance, in process (no server).

For each concurrency C: C greedy requests (ignore_eos) run first without speculation; their
outputs are the true continuations. Then, per draft source, the same requests with K drafts a
round: `oracle:RATE` replays the true continuation, each draft right with probability RATE
(1 = always, 0 = never), `mtp` drafts with the model's MTP block, `dspark` with the DSpark draft of
--dspark FILE (then K <= its block size, and `mtp` is not benched in the same run: the backend
drafts with one module). Every run's tokens must equal
the plain run's (column `exact`). Timed: the decode phase only (from the pass after which no
prompt is left to the last token), less the passes that captured a capacity bucket's CUDA graph
(the first of each bucket after a run's configure: a one-time cost). Columns: measured
acceptance (accepted / proposed drafts), tok/s, speed-up over plain, passes, what a round costs in
plain steps ((plain passes / passes) / speed-up: a k + 1-row pass plus the rollback), the drafter's
ms per pass (the MTP block's own cost with `mtp`), sequences that turned speculation off.

Model and backend: --model FILE (default the embedded tiny model) [--mtp FILE] --backend
numpy|hip, or --synthetic 8layer|full (hip/synthetic.py's random Flash-shaped models
on the GPU: the 8-layer bf16 one (oracle drafts only), or 43 layers in the q2 policy with a random
MTP block, or with `--draft dspark` a random DSpark draft of 0731's settings instead, whose drafts
are almost never accepted but cost what real ones do: `draft ms/pass` is the module's own cost at
Flash's widths). Random drafts accept nothing, so for each module the speed-up is also given as its
measured round cost implies it at acceptances a real draft reaches (a draft accepted with
probability a, independently: (1 - a^(K+1)) / (1 - a) tokens a round), and the acceptance at which
it would match lucebox's published DSpark speed-up on code (39 tok/s against 25.3 plain).
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np

from ..console import HelpFormatter
from ..scheduler.engine import Engine
from ..scheduler.request import Request, TokenEvent
from ..scheduler.speculative import BackendDrafter, OracleDrafter
from .bench_util import text_table


class TimedDrafter:
    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def draft(self, requests, seqs):
        t = time.perf_counter()
        out = self.inner.draft(requests, seqs)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out


def decode_run(model, backend: str, reqs: list[Request], C: int, k: int = 0, make_drafter=None, min_rate=None):
    """(outputs, decode tok/s, decode passes, engine, timed drafter): the decode phase timed.
    make_drafter(backend) builds the drafter over the run's own backend."""
    # a pool for these requests alone: the default (every slot at full context) is more device
    # memory than Flash's weights leave
    pool = C * (max(len(r.prompt_ids) for r in reqs) + max(r.max_new_tokens for r in reqs) + 256)
    eng = Engine(model, max_concurrency=C, backend=backend, speculative_tokens=k, prefix_cache=False,
                 drafter=TimedDrafter(None) if k else None, spec_min_rate=min_rate, kv_pool_tokens=pool)
    timed = None
    if k:
        timed = eng.seq_engine.drafter = TimedDrafter(make_drafter(eng.seq_engine.backend))
    sch = eng.scheduler
    for r in reqs:
        sch.submit(r)
    outs = {r.req_id: [] for r in reqs}
    t0, tokens, passes, capturing = None, 0, 0, 0.0
    captures = lambda: getattr(eng.seq_engine.backend, "capture_count", 0)  # noqa: E731
    while sch.has_work():
        before, t = captures(), time.perf_counter()
        new = [ev for ev in sch.step() if isinstance(ev, TokenEvent)]
        for ev in new:
            outs[ev.req_id].append(ev.token)
        if t0 is None:
            if not any(s.prompting for s in eng.seq_engine.live()):
                t0 = time.perf_counter()  # every prompt is in: decoding from here on
        elif captures() != before:
            # the first pass of a capacity bucket since configure captured its graph: a one-time
            # cost, not decoding's, so its time and tokens stay out (as decode_gpu.py's warm-up)
            capturing += time.perf_counter() - t
        else:
            tokens += len(new)
            passes += 1
    dt = time.perf_counter() - (t0 or time.perf_counter()) - capturing
    return [outs[r.req_id] for r in reqs], tokens / dt if dt else 0.0, passes, eng, timed


def synthetic(which: str, dspark: bool = False):
    """A model stand-in over hip.synthetic's random device weights; `full` with a random MTP block,
    or with dspark a random DSpark draft (their drafts are almost never accepted, but they cost
    what real ones do)."""
    from ..hip.backend import HipBackend
    from ..hip.synthetic import make_dspark, make_model, make_mtp
    rt, cfg, dw, ref, what = make_model(which == "full")
    mtp = mdw = ds = ddw = None
    if which == "full":
        mtp, mdw = (None, None) if dspark else make_mtp(rt, cfg, dw)
        ds, ddw = make_dspark(rt, cfg, dw) if dspark else (None, None)
    print(what + (", with a random MTP block" if mtp else ", with a random DSpark draft" if ds else ""), flush=True)
    # each run's configure() releases the last's state
    backend = HipBackend(ref.config, ref.weights, ref.numerics, ref.tables, runtime=rt, device_weights=dw,
                         mtp=mtp, mtp_device_weights=mdw, dspark=ds, dspark_device_weights=ddw)
    return SimpleNamespace(config=cfg, mtp=mtp, dspark=ds and SimpleNamespace(config=ds.dspark),
                           make_backend=lambda name=None: backend)


PEER_SPEEDUP = 39 / 25.3  # lucebox's DSpark on code: 39 tok/s against 25.3 plain (its README's figure)
ACCEPTANCES = (0.6, 0.7, 0.8)


def tokens_a_round(a: float, k: int) -> float:
    """Expected tokens a round of k drafts gives when each is accepted with probability a."""
    return k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def acceptance_for(speedup: float, round_cost: float, k: int) -> float | None:
    """The per-draft acceptance at which rounds of this cost (in plain steps) give `speedup`."""
    if tokens_a_round(1.0, k) < speedup * round_cost:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_a_round(mid, k) < speedup * round_cost else (lo, mid)
    return hi


DRAFT_MODULES = ("mtp", "dspark")


def parse_draft(text: str):
    if text in DRAFT_MODULES:
        return text
    kind, _, rate = text.partition(":")
    if kind != "oracle" or not rate:
        raise argparse.ArgumentTypeError(f"a draft source is oracle:RATE, mtp or dspark, got {text!r}")
    return float(rate)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds4ref.cli.bench --speculative-tokens K",
                                description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--speculative-tokens", type=int, required=True, metavar="K", help="drafts per round")
    p.add_argument("--draft", type=parse_draft, action="append", default=None,
                   help="oracle:RATE, mtp or dspark; repeatable (default oracle:1, oracle:0.7, oracle:0.5, "
                        "oracle:0, and dspark with --dspark, else mtp when the model has an MTP block)")
    p.add_argument("--concurrency", default="1,4,16", help="e.g. 1,4,16")
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded tiny model)")
    p.add_argument("--mtp", default=None, help="separate MTP GGUF for --model")
    p.add_argument("--dspark", default=None, metavar="FILE", help="DSpark draft GGUF for --model")
    p.add_argument("--backend", choices=("numpy", "hip"), default="numpy")
    p.add_argument("--synthetic", choices=("8layer", "full"), default=None,
                   help="hip/synthetic.py's random Flash-shaped model on the GPU (full: with a random MTP block)")
    p.add_argument("--prompt-tokens", type=int, default=24, help="prompt length (ragged +-50%%)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--no-auto-off", action="store_true", help="keep drafting whatever the acceptance")
    args = p.parse_args(argv)
    k = args.speculative_tokens
    if args.synthetic:
        model, backend = synthetic(args.synthetic, dspark=args.synthetic == "full" and "dspark" in (args.draft or ())), "hip"
    else:
        from ..model import load
        model, backend = load(args.model, backend=args.backend, mtp=args.mtp, dspark=args.dspark), args.backend
    dspark = getattr(model, "dspark", None)
    module = ["dspark"] if dspark is not None else ["mtp"] if model.mtp is not None else []
    drafts = args.draft or [1.0, 0.7, 0.5, 0.0] + module
    if "dspark" in drafts and dspark is None:
        p.error("--draft dspark needs a DSpark draft: give it with --dspark FILE (or --synthetic full's random one)")
    if "dspark" in drafts and k > dspark.config.block_size:
        p.error(f"--draft dspark proposes at most {dspark.config.block_size} tokens a round (its block size): "
                f"--speculative-tokens {k} is more")
    if "mtp" in drafts and dspark is not None:
        p.error("--draft mtp: with --dspark the backend drafts with DSpark; bench the MTP block in a run "
                "without --dspark")
    if "mtp" in drafts and model.mtp is None:
        p.error("--draft mtp needs a model with an MTP block: this one has none"
                + (" (--synthetic full carries a random one, --synthetic 8layer does not)" if args.synthetic else ""))
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    rows, implied = [], []
    for C in [int(c) for c in args.concurrency.split(",")]:
        lens = rng.integers(max(1, args.prompt_tokens // 2), args.prompt_tokens * 3 // 2 + 1, C)
        prompts = [[int(t) for t in rng.integers(2, V, n)] for n in lens]
        reqs = lambda: [Request(pr, args.max_tokens, ignore_eos=True, req_id=10_000 + i)  # noqa
                        for i, pr in enumerate(prompts)]
        decode_run(model, backend, reqs(), C)  # warm-up: compiles, caches, graphs
        truth, base, base_passes, _, _ = decode_run(model, backend, reqs(), C)
        rows.append([str(C), "plain", "-", f"{base:.1f}", "1.00", str(base_passes), "-", "-", "-", "yes"])
        truths = {10_000 + i: t for i, t in enumerate(truth)}
        for d in drafts:
            make = BackendDrafter if d in DRAFT_MODULES else (lambda be, d=d: OracleDrafter(truths, d, V))
            out, tps, passes, eng, timed = decode_run(model, backend, reqs(), C, k, make,
                                                      0.0 if args.no_auto_off else None)
            s = eng.scheduler.stats()
            acc = s["spec_accepted"] / s["spec_proposed"] if s["spec_proposed"] else 0.0
            round_cost = base_passes / passes / (tps / base) if base and tps and passes else None
            rows.append([str(C), d if d in DRAFT_MODULES else f"oracle:{d:g}", f"{acc:.2f}", f"{tps:.1f}",
                         f"{tps / base:.2f}" if base else "-", str(passes),
                         f"{round_cost:.2f}" if round_cost else "-",
                         f"{1000 * timed.seconds / max(1, timed.calls):.2f}", str(s["spec_off"]),
                         "yes" if out == truth else "NO"])
            if d in DRAFT_MODULES and round_cost:
                need = acceptance_for(PEER_SPEEDUP, round_cost, k)
                implied.append([str(C), d, f"{round_cost:.2f}", f"{1000 * timed.seconds / max(1, timed.calls):.2f}",
                                *(f"{tokens_a_round(a, k) / round_cost:.2f}" for a in ACCEPTANCES),
                                "-" if need is None else f"{need:.2f}"])
        print(f"C={C} done", flush=True)
    cols = [("C", 3), ("draft", 10), ("accept", 6), ("tok/s", 8), ("speedup", 7), ("passes", 6),
            ("round/step", 10), ("draft ms/pass", 13), ("auto-off", 8), ("exact", 5)]
    print(text_table(cols, rows, f"K = {k} drafts a round; {backend} backend; decode phase only; "
                                 f"auto-off {'disabled' if args.no_auto_off else 'on'}"))
    if implied:
        cols = [("C", 3), ("draft", 6), ("round/step", 10), ("draft ms/pass", 13),
                *((f"x @ a={a:g}", 9) for a in ACCEPTANCES), (f"a for x{PEER_SPEEDUP:.2f}", 11)]
        print(text_table(cols, implied, f"the speed-up each module's measured round cost implies at acceptance a "
                                        f"(K = {k}), and the acceptance that gives lucebox's x{PEER_SPEEDUP:.2f}"))
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
