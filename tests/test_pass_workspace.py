"""The hip pass workspace is sized by the context a lane can reach (the server's max_context
within the pool and the model's context), not by the pool: what the launchers ask for never
exceeds what configure allocates, and the engine never sends a row past it. No GPU: passes
are recorded on test_hip_program's runtime, which runs nothing."""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ds4ref.backend import Row, StepPlan
from ds4ref.hip.backend import HipBackend
from ds4ref.hip.device_state import lane_context, max_pages_per_slot
from ds4ref.hip.device_weights import DeviceWeights
from ds4ref.hip.launch import LARGEST_PASS, expert_list_ints, expert_tiles_ints
from ds4ref.hip.synthetic import flash_config as flash_shaped
from ds4ref.hip.workspace import (JOINT_OUTPUTS, WorkspaceError, check_pass_fits, flash_table, pass_workspace,
                                  rope_positions, workspace_sizes)
from ds4ref.gguf.tiny import flash_config, tiny_config
from ds4ref.numerics.tables import Tables
from ds4ref.scheduler import Request
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler.hash_backend import HashBackend
from test_hip_program import rt  # noqa: F401 - the fixture

K64, M1, T, GiB = 1 << 16, 1 << 20, 128, 1 << 30
VIEWS = {second for _, second in JOINT_OUTPUTS}  # the second half of a joint allocation: no bytes of its own
# Flash (DS4_SPEC §1): 64 heads of 512, a window of 128, ratio-4 layers keeping the top 512
# indexer rows, ratio-128 layers reading every compressed row; attention slices of 32 keys
H, D, W, TOPK, SLICE = 64, 512, 128, 512, 32


def flash_slices(context: int) -> int:
    """Key slices of the widest layer: ratio 128's window plus every compressed row (and one
    more), ratio 4's window plus its top-k."""
    return -(-max(W + context // 128 + 1, W + min(TOPK, context // 4)) // SLICE)


def holds(cfg, rows: int, n_pages: int, max_context) -> dict[str, int]:
    """What a workspace configured for these lanes holds for one lane, from workspace_sizes."""
    maxp = max_pages_per_slot(n_pages, T, lane_context(cfg, n_pages, T, max_context))
    sizes = workspace_sizes(cfg, rows, maxp, T, quantised_products=True)
    return {"RoPE rows": rope_positions(cfg, n_pages, T, max_context), "indexer scores": sizes["scores"],
            "attention slices": sizes["at_m"] // cfg.n_head}


def test_flash_at_64k_sizes_the_workspace_by_the_lanes_context():
    """16 lanes x 64K on Flash: a pool of 8,192 pages (1M positions), but a lane reaches 64K, so
    the attention partials and indexer scores are 64K's, not 1M's; the 2,048-row pass needs
    9.8 GiB instead of 72.4, the 4,096-row pass 19.4 instead of 144.1."""
    cfg = flash_config()
    n_pages = 16 * K64 // T
    assert flash_slices(K64) == 21 and flash_slices(M1) == 261
    for rows in (256, 1024, 2048, 4096):
        sized = pass_workspace(cfg, 16, n_pages, T, rows, "compact", "official", K64)
        by_pool = pass_workspace(cfg, 16, n_pages, T, rows, "compact", "official")
        assert by_pool == pass_workspace(cfg, 16, n_pages, T, rows, "compact", "official", M1)
        # per row: partials (max, denominator, accumulator) of every (head, slice), and one score
        # per ratio-4 row; per position: cos and sin of both RoPE kinds; per lane: a block-table entry
        per_row = 4 * (H * (D + 2) * (flash_slices(M1) - flash_slices(K64)) + (M1 - K64) // 4)
        assert by_pool - sized == rows * per_row + 2 * 2 * 4 * 32 * (M1 - K64) + 16 * 4 * (M1 - K64) // T
    table = flash_table()
    assert "| 65,536 (8,192 pages) | the lanes' context | 1.3 GiB | 4.9 GiB | 9.8 GiB | 19.4 GiB |" in table
    doc = (Path(__file__).parents[1] / "docs" / "paging.md").read_text()
    assert all(f"  {line}\n" in doc for line in table.splitlines())  # the table docs/paging.md prints
    assert round(pass_workspace(cfg, 16, n_pages, T, 2048, "compact", "official", K64) / GiB, 1) == 9.8
    assert round(pass_workspace(cfg, 16, n_pages, T, 2048, "compact", "official") / GiB, 1) == 72.4
    assert round(pass_workspace(cfg, 16, n_pages, T, LARGEST_PASS, "compact", "official", K64) / GiB, 1) == 19.4


# a pool of 16 lanes' 64K (larger than a lane's context), a pool smaller than max_context, and
# no max_context (the model's 1M) with a 64K pool: the pool bounds a lane
@pytest.mark.parametrize("max_context, n_pages", [(K64, 16 * K64 // T), (K64, 100), (None, 512)])
def test_the_largest_flash_shaped_backend_allocates_its_plan(rt, max_context, n_pages):  # noqa: F811
    """Configured for lanes of max_context positions, HipBackend allocates what pass_workspace
    plans, byte for byte, and every recorded attention, indexer and expert-list launch stays within
    it: Flash's 256 experts in passes of up to launch.LARGEST_PASS rows."""
    cfg = flash_shaped(4, 256, M1)
    assert {r for r in cfg.compress_ratios if r} == {4, 128}
    dw = DeviceWeights.random_flash(rt, cfg, big=0)
    backend = HipBackend(cfg, None, "official", Tables.build(cfg, np.float32), runtime=rt, device_weights=dw,
                         prefill_rows=LARGEST_PASS)
    backend.configure(16, n_pages, T, max_context=max_context)
    st_ = backend.state
    reach = min(max_context or M1, n_pages * T)
    assert st_.context == reach and st_.maxp == -(-reach // T)
    assert backend.holds == holds(cfg, LARGEST_PASS, n_pages, max_context)
    assert backend.at_nz == flash_slices(reach) and backend.ncap4 == st_.maxp * T // 4
    beside_state = (st_.btab.nbytes + st_.lanes.nbytes + sum(b.nbytes for b in backend.rope_cs.values())
                    + sum(b.nbytes for name, b in backend._ws.items() if name not in VIEWS))
    assert beside_state == pass_workspace(cfg, 16, n_pages, T, LARGEST_PASS, "compact", "official", max_context)
    ws = backend._ws
    # the grouped expert GEMM's row tiles of the largest pass (HipBackend._experts)
    assert 4 * expert_tiles_ints(cfg.n_expert, cfg.n_expert_used, LARGEST_PASS) <= ws["etiles"].nbytes
    for L, program in backend.programs.items():
        for kernel, grid, _block, args, _shared in program.ops:
            if kernel.name == "step_attention_split":
                assert grid[1] == L and grid[2] == backend.at_nz
                assert all(4 * L * H * grid[2] * n <= ws[b].nbytes for b, n in (("at_m", 1), ("at_acc", D)))
            elif kernel.name == "step_indexer_paged":
                assert 4 * L * int(args[-1]) <= ws["scores"].nbytes and int(args[-1]) == backend.ncap4
            elif kernel.name == "step_expert_list":
                assert int(args[2]) == L
                assert 4 * expert_list_ints(cfg.n_expert, cfg.n_expert_used, L) <= ws["elist"].nbytes


def test_a_row_past_the_lanes_context_is_refused_before_it_runs(rt):  # noqa: F811
    """A block table maps whole pages, so a slot may map positions past max_context (300 of a
    384-position table); the backend refuses a row there, naming the sizes, before any launch."""
    cfg = tiny_config()
    dw = DeviceWeights.random_flash(rt, cfg, big=1 << 30)
    backend = HipBackend(cfg, None, "official", Tables.build(cfg, np.float32), runtime=rt, device_weights=dw)
    backend.configure(2, 8, T, max_context=300)
    assert backend.state.maxp == 3 and backend._rope_rows == 300
    backend.reset_slot(0)
    backend.set_block_table(0, [0, 1, 2])
    with pytest.raises(ValueError, match="exceed the per-slot capacity 3"):
        backend.set_block_table(0, [0, 1, 2, 3])
    for start in (0, 256):
        backend.step(StepPlan.from_rows([Row(0, p, 2, False, False) for p in range(start, min(start + 256, 300))],
                                        backend.max_pass_rows))
    before = len(rt.launches)
    with pytest.raises(WorkspaceError, match="position 300 needs 301 RoPE rows, but the workspace holds 300"):
        backend.step(StepPlan.from_rows([Row(0, 300, 2)], backend.max_pass_rows))
    assert len(rt.launches) == before and backend.state.next_pos[0] == 300


class SizedHashBackend(HashBackend):
    """The hash backend, checking every pass against a Flash workspace configured as it is."""

    def configure(self, n_slots, n_pages, page_tokens=T, max_context=None):
        super().configure(n_slots, n_pages, page_tokens, max_context)
        self.context, self.most = max_context, -1
        self.holds = holds(flash_config(), self.max_pass_rows, n_pages, max_context)

    def step(self, plan):
        last = int(plan.positions[plan.slots >= 0].max())
        check_pass_fits(flash_config(), last, self.holds, self.context)
        self.most = max(self.most, last)
        return super().step(plan)


@settings(max_examples=12, deadline=None)
@given(lanes=st.integers(1, 4), rows=st.sampled_from([16, 32, 64]), max_context=st.integers(2, 700),
       spare_pages=st.one_of(st.none(), st.integers(0, 6)), data=st.data())
def test_no_admissible_request_mix_outgrows_the_workspace(lanes, rows, max_context, spare_pages, data):
    """Whatever requests arrive (prompts up to the limit, max_tokens past it), the engine
    configures the backend with its max_context and sends no row the workspace cannot hold: the
    furthest row is within the lanes' context, and a request that asks past it ends at it."""
    pool = None if spare_pages is None or lanes == 1 else (-(-max_context // T) + spare_pages) * T
    model = types.SimpleNamespace(config=types.SimpleNamespace(eos_id=1, vocab_size=32, context_length=M1),
                                  make_backend=lambda name=None: SizedHashBackend(32, rows))
    eng = Engine(model, lanes, kv_pool_tokens=pool, max_context=max_context)
    backend = eng.seq_engine.backend
    assert backend.context == max_context
    n = data.draw(st.integers(1, 6), label="requests")
    reqs = [Request([2 + (7 * i + j) % 29 for i in range(data.draw(st.integers(1, max_context - 1)))],
                    data.draw(st.integers(1, 2 * max_context)), ignore_eos=True) for j in range(n)]
    outs = eng.run(reqs)
    for r, out, fin in zip(reqs, outs, eng.finishes):
        assert len(out) == min(r.max_new_tokens, max_context - len(r.prompt_ids)) and fin.reason == "length"
    reach = lane_context(flash_config(), eng.seq_engine.pool.n_pages, T, max_context)
    assert backend.most == max(len(r.prompt_ids) + len(o) - 2 for r, o in zip(reqs, outs)) <= reach - 1
