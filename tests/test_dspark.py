"""DSpark drafts (docs/mtp.md, "DSpark") beside the tiny DeepSeek-V4-Flash-0731 model: the draft
against the official formulas written out in float64, its GGUF layouts (llama.cpp's dflash file,
antirez/ds4's support file in both its key sets) giving the same drafts, clear errors, and
speculative decoding with DSpark drafts changing no token or logprob. The dflash file's layout and
the draft-to-model checks: tests/test_0731.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ds4ref
from ds4ref.gguf.dspark import SUPPORT_ARCH, DSparkError
from ds4ref.gguf.dspark_file import load_dspark
from ds4ref.gguf.file import open_gguf, write_tensor_file
from ds4ref.gguf.tiny import random_dspark, tiny_0731_config, write_tiny
from ds4ref.reference import ops
from ds4ref.reference.layers import LayerWeights, attention_output, ffn_block, hc
from ds4ref.scheduler import Request, Sampling
from ds4ref.scheduler.engine import Engine
from official64 import hc_head, rms, rope
from test_speculative import trace  # per request: its token events and its finish

IDS = [5, 77, 300, 12, 9, 401, 33, 250, 18, 64, 100, 7, 222, 91, 3, 480, 17, 58, 199, 2, 45, 310]


@pytest.fixture(scope="session")
def tiny(tiny_0731):
    """The tiny 0731 model with its DSpark draft (conftest's tiny_0731: llama.cpp's dflash file)."""
    return ds4ref.load(tiny_0731[0], dspark=tiny_0731[1])


@pytest.fixture(scope="session")
def all_f32(tmp_path_factory):
    """The tiny 0731 model and its draft with every tensor f32: official float32 products of
    block-quantised weights quantise their inputs to Q8 (canon.qlinear), which a float64 formula
    would not."""
    path = tmp_path_factory.mktemp("dspark") / "f32.gguf"
    write_tiny(path, tiny_0731_config(), dtypes={}, dspark=path.with_name("dspark-f32.gguf"))
    return path, path.with_name("dspark-f32.gguf")


def _tapped(model, ids):
    st = model.reference.new_state()
    return model.reference.step_rows([st] * len(ids), ids, np.arange(len(ids)), taps=model.dspark.taps)


def _draft(model, hidden, anchor, split=None):
    """Feed the context rows (in passes of `split` rows, default all at once), then draft."""
    ds = model.dspark.new_state()
    split = split or len(hidden)
    for p in range(0, len(hidden), split):
        model.dspark.feed([ds] * len(hidden[p:p + split]), hidden[p:p + split], np.arange(p, p + len(hidden[p:p + split])))
    return model.dspark.draft([ds], [anchor])


# ---- the official formulas in float64 ---------------------------------------------------------
def _float64_dspark(m64, hidden, anchor):
    """The official DSpark formulas in float64, written out here for what is DSpark's own (main_proj
    and main_norm, each stage's window rows from them, the block's attention over window + block
    with no mask, the hc head, the Markov chain, the confidence head); HC pre/post, the output
    projection's grouping and the FFN are the main layers' float64 code."""
    d, dc = m64.dspark, m64.dspark.config
    sc, w = d.stages, d.weights
    g = lambda s, n: w.get(f"mtp.{s}.{n}")  # noqa: E731
    eps, B, W, last = sc.rms_eps, dc.block_size, sc.sliding_window, dc.n_stages - 1
    omega = m64.reference.tables.omega(0).astype(np.float64)
    official = m64.numerics == "official"
    p = len(hidden) - 1
    main_x = rms(hidden @ g(0, "main_proj.weight").T, g(0, "main_norm.weight"), eps)
    ctx = np.arange(max(0, p - W + 1), p + 1)
    block_pos = p + 1 + np.arange(B)
    tokens = np.array([anchor] + [dc.noise_token_id] * (B - 1))
    x = np.repeat(m64.weights.get("token_embd.weight")[tokens][:, None], sc.hc_mult, axis=1)
    for s in range(dc.n_stages):
        lw = LayerWeights(w, s, m64.numerics, prefix=f"mtp.{s}.")
        window = rope(rms(main_x[ctx] @ g(s, "attn_kv.weight").T, g(s, "attn_kv_a_norm.weight"), eps), ctx, omega)
        u, post, comb = hc(lw, "attn", sc, x)
        a = rms(u, g(s, "attn_norm.weight"), eps)
        q = (rms(a @ g(s, "attn_q_a.weight").T, g(s, "attn_q_a_norm.weight"), eps)
             @ g(s, "attn_q_b.weight").T).reshape(B, sc.n_head, sc.head_dim)
        q = rope(q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + eps), block_pos, omega)
        kv = rope(rms(a @ g(s, "attn_kv.weight").T, g(s, "attn_kv_a_norm.weight"), eps), block_pos, omega)
        if official:
            window, kv = ops.fp8sim(window, sc.n_rot), ops.fp8sim(kv, sc.n_rot)
        keys = np.concatenate([window, kv])  # every block row sees the window and the whole block
        z = np.einsum("bhd,nd->bhn", q, keys) / np.sqrt(sc.head_dim)
        sink = g(s, "attn_sinks.weight")[None, :, None]
        mx = np.maximum(z.max(-1, keepdims=True), sink)
        e = np.exp(z - mx)
        o = (e @ keys) / (np.exp(sink - mx) + e.sum(-1, keepdims=True))
        o = rope(o, block_pos, omega, inverse=True)
        cos0, sin0 = np.ones((B, len(omega))), np.zeros((B, len(omega)))  # already un-rotated above
        x = ops.hc_post(x, attention_output(lw, sc, o, cos0, sin0), post, comb)
        x = ffn_block(lw, sc, s, x, tokens)
    h = hc_head(x, g(last, "hc_head_fn.weight"), g(last, "hc_head_scale.weight"), g(last, "hc_head_base.weight"),
                eps, sc.hc_eps)
    base = rms(h, g(last, "norm.weight"), eps) @ m64.weights.get("output.weight").T
    drafts, logits, conf, prev = [], [], [], anchor
    for i in range(B):
        e = g(last, "markov_head.markov_w1.weight")[prev]
        logits.append(base[i] + g(last, "markov_head.markov_w2.weight") @ e)
        prev = int(np.argmax(logits[-1]))
        drafts.append(prev)
        conf.append(float(g(last, "confidence_head.proj.weight")[0] @ np.concatenate([h[i], e])))
    return np.array(drafts), np.array(logits), np.array(conf)


@pytest.mark.parametrize("numerics", ["official", "plain"])
@pytest.mark.parametrize("n_ctx", [3, 20])  # a window not yet full (16 rows), and one that has wrapped
def test_float32_draft_is_the_official_formulas(numerics, n_ctx, all_f32):
    path, dspark = all_f32
    m32 = ds4ref.load(path, numerics=numerics, dspark=dspark)
    m64 = ds4ref.load(path, numerics=numerics, dtype=np.float64, dspark=dspark)
    ids = IDS[:n_ctx + 1]
    _, hidden = _tapped(m32, ids)  # both sides take the same target hidden states: the draft alone is compared
    got = _draft(m32, hidden[:n_ctx], ids[n_ctx])
    tokens, logits, conf = _float64_dspark(m64, hidden[:n_ctx].astype(np.float64), ids[n_ctx])
    assert got.tokens[0].tolist() == tokens.tolist()
    # a tolerance only because one side is float64: the float32 side is the canonical arithmetic
    np.testing.assert_allclose(got.logits[0], logits, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(got.confidence[0], conf, rtol=2e-4, atol=2e-4)


def test_target_taps_are_the_stream_means_after_those_layers(tiny):
    """What the target hands the draft: per row the mean of its streams after each target layer
    (official Transformer.forward: main_hiddens.append(h.mean(dim=2)) after layer i), and the
    logits are the same bits as without taps."""
    from ds4ref.reference.decode import Rows, block, embed
    ref = tiny.reference
    logits, tapped = _tapped(tiny, IDS[:6])
    st = ref.new_state()
    assert logits.tobytes() == ref.step_rows([st] * 6, IDS[:6], np.arange(6)).tobytes()
    st, rows = ref.new_state(), None
    streams = embed(ref.weights, IDS[:6], ref.config)
    rows = Rows.of([st] * 6, IDS[:6], np.arange(6))
    want = []
    for il in range(ref.config.n_layer):
        streams = block(LayerWeights(ref.weights, il, ref.numerics), ref.config, ref.tables, ref.numerics, rows, il,
                        streams)
        if il in tiny.dspark.taps:
            want.append(sum(streams[:, k].astype(np.float64) for k in range(streams.shape[1])) / streams.shape[1])
    np.testing.assert_allclose(tapped, np.concatenate(want, axis=1), rtol=1e-6, atol=1e-6)  # float64 sum: rounding


def test_context_rows_in_any_passes_give_the_same_draft(tiny):
    _, hidden = _tapped(tiny, IDS)
    one = _draft(tiny, hidden[:-1], IDS[-1])
    for split in (1, 5):
        other = _draft(tiny, hidden[:-1], IDS[-1], split)
        assert other.tokens.tobytes() == one.tokens.tobytes() and other.logits.tobytes() == one.logits.tobytes()


def test_several_sequences_draft_as_each_alone(tiny):
    _, hidden = _tapped(tiny, IDS)
    a, b = tiny.dspark.new_state(), tiny.dspark.new_state()
    tiny.dspark.feed([a] * 7 + [b] * 12, np.concatenate([hidden[:7], hidden[:12]]), list(range(7)) + list(range(12)))
    both = tiny.dspark.draft([a, b], [IDS[7], IDS[12]])
    for i, n in enumerate((7, 12)):
        alone = _draft(tiny, hidden[:n], IDS[n])
        assert both.tokens[i].tobytes() == alone.tokens[0].tobytes()
        assert both.logits[i].tobytes() == alone.logits[0].tobytes()


# ---- the GGUF layouts ---------------------------------------------------------------------------
def _antirez_file(path, model_path, dc, layout, drop=None, **meta):
    """The draft under our names (= antirez/ds4's) with the keys of antirez/ds4's
    gguf-tools/deepseek4-quantize.c: `support` its --dspark-support file (architecture
    deepseek4-dspark, dspark.* keys, target ids as one u32 array), `inline` its earlier
    --dspark-only file (the template model's deepseek4.* keys, deepseek4.dspark.*, one u32 key a
    target layer)."""
    tensors, dtypes = random_dspark(open_gguf(model_path).config, dc)
    if layout == "support":
        keys, arch = {"dspark.block_size": dc.block_size, "dspark.markov_rank": dc.markov_rank,
                      "dspark.noise_token_id": dc.noise_token_id, "dspark.target_layer_ids": list(dc.target_layers),
                      "dspark.stage_count": dc.n_stages, "dspark.n_layers": dc.n_stages}, SUPPORT_ARCH
    else:
        keys = {k: v for k, v in open_gguf(model_path).metadata.items() if not k.startswith("general.")}
        keys.update({"deepseek4.dspark.n_mtp_layers": dc.n_stages, "deepseek4.dspark.block_size": dc.block_size,
                     "deepseek4.dspark.noise_token_id": dc.noise_token_id,
                     "deepseek4.dspark.markov_rank": dc.markov_rank,
                     **{f"deepseek4.dspark.target_layer_ids.{i}": t for i, t in enumerate(dc.target_layers)}})
        arch = "deepseek4"
    tensors.pop(drop, None)
    write_tensor_file(path, {**keys, **meta}, tensors, dtypes, arch=arch)
    return path


@pytest.mark.parametrize("layout", ["support", "inline"])
def test_antirez_layouts_give_the_same_drafts(tmp_path, tiny, tiny_0731, layout):
    dc = tiny.dspark.config
    other = ds4ref.load(tiny_0731[0], dspark=_antirez_file(tmp_path / "support.gguf", tiny_0731[0], dc, layout))
    assert other.dspark.config == dc
    _, hidden = _tapped(tiny, IDS)
    a, b = _draft(tiny, hidden[:-1], IDS[-1]), _draft(other, hidden[:-1], IDS[-1])
    assert a.tokens.tobytes() == b.tokens.tobytes() and a.logits.tobytes() == b.logits.tobytes()
    assert a.confidence.tobytes() == b.confidence.tobytes()


def test_errors(tmp_path, tiny, tiny_0731):
    model, draft = tiny_0731
    mf, dc = open_gguf(model), tiny.dspark.config
    with pytest.raises(DSparkError, match="missing DSpark tensor 'mtp.2.markov_head.markov_w2.weight'"):
        load_dspark(_antirez_file(tmp_path / "a.gguf", model, dc, "support",
                                  drop="mtp.2.markov_head.markov_w2.weight"), mf)
    with pytest.raises(DSparkError, match=r"after target layers \[4, 5, 6\], the model has 6 layers"):
        load_dspark(_antirez_file(tmp_path / "b.gguf", model, dc, "support", **{"dspark.target_layer_ids": [4, 5, 6]}),
                    mf)
    with pytest.raises(DSparkError, match="dspark.n_layers = 2 and dspark.stage_count = 3 disagree"):
        load_dspark(_antirez_file(tmp_path / "c.gguf", model, dc, "support", **{"dspark.n_layers": 2}), mf)
    with pytest.raises(DSparkError, match="not a DSpark GGUF"):
        load_dspark(ds4ref.gguf.tiny.default_mtp_path(), mf)
    with pytest.raises(DSparkError, match=f"{draft} belongs to another model than .*: .* the model is the original"):
        ds4ref.load(dspark=draft)  # the embedded original tiny: same sizes, no 0731
    with pytest.raises(ValueError, match="at most 5 tokens a round"):
        Engine(tiny, 1, speculative_tokens=6)


# ---- speculative decoding with DSpark drafts ----------------------------------------------------
SAMPLINGS = [Sampling(), Sampling(logprobs=2), Sampling(temperature=0.9, top_k=20, seed=7, logprobs=3)]


@settings(max_examples=3, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.integers(0, 500)),
                min_size=2, max_size=3),
       st.integers(1, 5), st.booleans())
def test_dspark_speculation_is_exact(tiny, reqs, k, cache):
    """Ragged prompts, several requests at once, greedy and sampled with logprobs: an engine whose
    drafts are DSpark's (random weights: nearly every round rolls back) gives plain decoding's
    tokens, logprobs and finishes."""
    make = lambda: [Request([(7 * i + salt) % 500 + 2 for i in range(n)], m, SAMPLINGS[s], ignore_eos=True,  # noqa
                            req_id=1000 + j) for j, (n, m, s, salt) in enumerate(reqs)]
    plain = Engine(tiny, 2, prefix_cache=cache)
    plain.run(make())
    eng = Engine(tiny, 2, prefix_cache=cache, speculative_tokens=k, spec_min_rate=0.0)
    eng.run(make())
    assert trace(eng, len(reqs)) == trace(plain, len(reqs))
    assert eng.scheduler.stats()["spec_rounds"] > 0 or all(m == 1 for _, m, _, _ in reqs)


# ---- memory plan, bench and server flags --------------------------------------------------------
def test_memory_plan_counts_the_draft_rings_and_weights(tiny, tiny_0731):
    from ds4ref.serve import plan_start
    model, draft = (str(p) for p in tiny_0731)
    _, without = plan_start(model, "numpy", "official", 2, None, None, prefix_cache=False)
    _, plan = plan_start(model, "numpy", "official", 2, None, None, prefix_cache=False, dspark=draft)
    backend = tiny.make_backend()
    backend.configure(plan.lanes, plan.n_pages)
    assert sum(s.rings.nbytes for s in backend.draft_states) == plan.draft > 0
    assert plan.weights - without.weights == load_dspark(draft, open_gguf(model)).stored_bytes()
    # on hip: the rings of W + B rows a stage (hip/dspark.py) and its pass buffers, as configure allocates
    from ds4ref.hip.dspark import device_bytes
    _, on_hip = plan_start(model, "hip", "official", 2, None, None, prefix_cache=False, dspark=draft)
    d = load_dspark(draft, open_gguf(model))
    assert on_hip.draft == device_bytes(d.config, d.dspark, on_hip.lanes, on_hip.n_pages, on_hip.page_tokens,
                                        on_hip.workspace_rows, on_hip.storage == "compact", on_hip.context)
    from ds4ref.hip.dspark import state_config
    from ds4ref.paging.layout import PageLayout
    rings = state_config(d.config, d.dspark)
    assert rings.sliding_window == d.config.sliding_window + d.dspark.block_size
    assert on_hip.mtp_slot == PageLayout(rings, on_hip.page_tokens).slot_bytes(on_hip.storage)


def test_bench_drafts_with_dspark_exactly(tiny_0731, capsys):
    from ds4ref.cli.bench_spec import main
    model, draft = tiny_0731
    argv = ["--model", str(model), "--speculative-tokens", "3", "--concurrency", "2", "--max-tokens", "8",
            "--prompt-tokens", "8"]
    assert main(argv + ["--dspark", str(draft), "--draft", "dspark"]) == 0
    out = capsys.readouterr().out
    _, _, implied = out.partition("speed-up each module")[0].rpartition("round/step ")
    rows = {line.split()[1]: line.split() for line in out.split("x @ a=")[0].splitlines() if line.split()[:1] == ["2"]}
    assert set(rows) == {"plain", "dspark"} and all(r[-1] == "yes" for r in rows.values())
    # the implied speed-ups: the expected tokens of a round at acceptance a over its measured cost
    from ds4ref.cli.bench_spec import acceptance_for, tokens_a_round
    line = [row.split() for row in implied.splitlines() if row.split()[:2] == ["2", "dspark"]]
    assert len(line) == 1 and line[0][2] == rows["dspark"][6]
    cost = float(line[0][2])
    # within 0.02: the table divides by the unrounded cost, the test by the cost as printed (2 decimals)
    assert [float(x) for x in line[0][4:7]] == pytest.approx([tokens_a_round(a, 3) / cost for a in (0.6, 0.7, 0.8)],
                                                             abs=0.02)
    need = acceptance_for(39 / 25.3, cost, 3)
    assert (line[0][7] == "-") == (need is None)
    assert need is None or float(line[0][7]) == pytest.approx(need, abs=0.02)
    assert tokens_a_round(0.5, 3) == 1.875 and acceptance_for(1.0, 1.0, 3) < 1e-9
    for bad, why in ((["--draft", "dspark"], "needs a DSpark draft"),
                     (["--dspark", str(draft), "--draft", "mtp"], "drafts with DSpark"),
                     (["--dspark", str(draft), "--draft", "dspark", "--speculative-tokens", "6"], "at most 5")):
        with pytest.raises(SystemExit) as exc:
            main(argv + bad)
        assert exc.value.code == 2 and why in capsys.readouterr().err


def test_dspark_speculation_from_the_prefix_cache_is_exact(tiny):
    """A prompt that starts with a whole cached page (and its draft rings, from the snapshot) drafts
    from there: tokens and logprobs are plain decoding's, and the second request hit the cache."""
    shared = [(11 * i) % 500 + 2 for i in range(140)]
    make = lambda: [Request(shared + [7, 9, 11][:j + 1], 10, SAMPLINGS[j], ignore_eos=True, req_id=1000 + j)  # noqa
                    for j in range(2)]
    plain = Engine(tiny, 1)
    plain.run(make())
    eng = Engine(tiny, 1, speculative_tokens=4, spec_min_rate=0.0)
    eng.run(make())
    assert trace(eng, 2) == trace(plain, 2)
    assert eng.finishes[1].cached_tokens >= 128 and eng.scheduler.stats()["spec_rounds"] > 0
