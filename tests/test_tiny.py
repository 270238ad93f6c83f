"""The tiny random model: config, weights, determinism and the packaged file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ds4ref.gguf.file import open_gguf
from ds4ref.gguf.tensors import is_int_tensor, tensor_shapes
from ds4ref.gguf.tiny import default_model_path, main, random_tensors, tiny_config, write_tiny


def test_default_config_is_the_specified_one():
    c = tiny_config()
    assert (c.n_layer, c.n_embd, c.vocab_size, c.n_head, c.head_dim, c.n_rot) == (6, 128, 512, 4, 96, 32)
    assert c.compress_ratios == (0, 0, 4, 128, 4, 128)
    assert (c.q_lora_rank, c.o_lora_rank, c.o_groups) == (64, 64, 2)
    assert (c.n_expert, c.n_expert_used, c.n_expert_shared, c.expert_ff, c.n_hash_layers) == (8, 2, 1, 64, 3)
    assert (c.sliding_window, c.indexer_heads, c.indexer_head_dim, c.indexer_top_k) == (16, 8, 64, 8)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.context_length) == (4, 20, 4096)
    assert all(1.5 <= x <= 3.0 for x in c.swiglu_clamp) and len(set(c.swiglu_clamp)) > 1


def test_layer_override_extends_the_flash_schedule():
    assert tiny_config(n_layer=9).compress_ratios == (0, 0, 4, 128, 4, 128, 4, 128, 4)
    assert len(tiny_config(n_layer=9).swiglu_clamp) == 9


def test_random_tensors_cover_every_tensor():
    cfg = tiny_config()
    t = random_tensors(cfg, seed=5)
    shapes = tensor_shapes(cfg)
    assert set(t) == set(shapes)
    for name, arr in t.items():
        assert arr.shape == shapes[name], name
        assert arr.dtype == (np.int32 if is_int_tensor(name) else np.float32), name
        if arr.size > 1:  # every parameter kind is random, none left at a constant
            assert np.unique(arr).size > 1, name


def test_hash_routing_table_has_distinct_valid_experts():
    cfg = tiny_config()
    tid = random_tensors(cfg, seed=1)["blk.0.ffn_gate_tid2eid.weight"]
    assert tid.min() >= 0 and tid.max() < cfg.n_expert
    assert all(len(set(row)) == cfg.n_expert_used for row in tid.tolist())
    # every expert is used by some token, so hash layers exercise all of them
    assert set(np.unique(tid)) == set(range(cfg.n_expert))


def test_seeds_are_deterministic_and_distinct():
    cfg = tiny_config(n_layer=3)
    a, b, c = random_tensors(cfg, 7), random_tensors(cfg, 7), random_tensors(cfg, 8)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["token_embd.weight"], c["token_embd.weight"])


def test_write_tiny_is_deterministic(tmp_path):
    cfg = tiny_config(n_layer=3)
    write_tiny(tmp_path / "a.gguf", cfg, seed=2)
    write_tiny(tmp_path / "b.gguf", cfg, seed=2)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_packaged_files_are_current(tmp_path, tiny_model_path):
    # Regenerate with:
    # python -m ds4ref.gguf.tiny --out ds4ref/data/ds4-tiny.gguf --mtp-out ds4ref/data/mtp-ds4-tiny.gguf
    from ds4ref.gguf.tiny import default_mtp_path
    write_tiny(tmp_path / "fresh.gguf", seed=0, mtp=tmp_path / "mtp-fresh.gguf")
    assert tiny_model_path == default_model_path() and tiny_model_path.stat().st_size < 16 << 20
    assert tiny_model_path.read_bytes() == (tmp_path / "fresh.gguf").read_bytes()
    assert default_mtp_path().read_bytes() == (tmp_path / "mtp-fresh.gguf").read_bytes()


@pytest.mark.parametrize("policy", ["q2", "q4", "mxfp4"])
def test_policy_files_are_the_goldens_bytes(tmp_path, policy):
    """A fresh `tiny --policy P` file (not the test cache's) is the file the golden was made from,
    on any machine: its bytes must not depend on the CPU's SIMD width or the NumPy build.
    Regenerate with: python -m tests.golden.make_golden q2 q4 mxfp4"""
    from tests.golden.make_golden import POLICY_SEED, file_sha256
    golden = json.loads((Path(__file__).parent / "golden" / f"tiny_{policy}_official.json").read_text())
    write_tiny(tmp_path / "fresh.gguf", seed=POLICY_SEED, policy=policy)
    assert file_sha256(tmp_path / "fresh.gguf") == golden["model_sha256"]


@settings(max_examples=200, deadline=None)
@given(x=st.floats(1e-30, 1e30), n=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_generator_statistics_are_exact(x, n, seed):
    """The statistics behind stored scales: round(log2) without libm, mean/std correctly rounded."""
    import math
    from fractions import Fraction
    from ds4ref.gguf.tiny import exact_mean, exact_std, nearest_log2
    if abs(math.log2(x) % 1 - 0.5) > 1e-9:  # away from a half-integer, libm's log2 rounds the same way
        assert nearest_log2(x) == round(math.log2(x))
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    exact = sum(Fraction(float(v)) for v in values) / n
    assert exact_mean(values) == float(sum(Fraction(float(v)) for v in values)) / n
    assert exact_std(values) == pytest.approx(math.sqrt(float(sum((Fraction(float(v)) - exact) ** 2 for v in values) / n)),
                                              rel=1e-14)


def test_packaged_file_opens_with_the_tiny_config(tiny_file):
    assert tiny_file.config == tiny_config()
    assert tiny_file.metadata["tokenizer.ggml.pre"] == "joyai-llm"


def test_cli_writes_requested_layers(tmp_path, capsys):
    import ds4ref
    out = tmp_path / "cli.gguf"
    main(["--out", str(out), "--layers", "4", "--seed", "3", "--mtp-out", str(tmp_path / "mtp-cli.gguf")])
    cfg = open_gguf(out).config
    assert cfg.n_layer == 4 and cfg.compress_ratios == (0, 0, 4, 128)
    assert "4 layers" in capsys.readouterr().out
    assert ds4ref.load(out, mtp=tmp_path / "mtp-cli.gguf").mtp.config.n_embd == cfg.n_embd


def test_swiglu_clamps_bite_on_random_inputs(tiny_weights):
    # unit-RMS inputs (what rms(·; ffn_norm) produces) through layer 3's gate projection
    cfg = tiny_weights.config
    x = np.random.default_rng(0).standard_normal((64, cfg.n_embd)).astype(np.float32)
    g = x @ tiny_weights.expert("blk.3.ffn_gate_exps.weight", 0).T
    clipped = np.mean(g > cfg.swiglu_clamp[3])
    assert 0.05 < clipped < 0.6


def test_logits_are_peaked(tiny_weights):
    model_mod = pytest.importorskip("ds4ref.reference.model")
    ids = np.random.default_rng(4).integers(0, tiny_weights.config.vocab_size, 24)
    logits = model_mod.Model(tiny_weights).score(ids)
    assert np.all(np.isfinite(logits))
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert np.mean(top2[:, 1] - top2[:, 0] > 1e-3) > 0.9
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert np.median(p.max(1)) > 10 / tiny_weights.config.vocab_size  # far from uniform
    assert 0.3 < float(logits.std(1).mean()) < 30  # O(1) activations, no blow-up


# ---- published-policy files (python -m ds4ref.gguf.tiny --policy) -----------------------------------------------------



def _fsum(values) -> float:
    """The statistics' former definition, the oracle of exact_sum: math.fsum over a list."""
    import math
    return math.fsum(np.asarray(values, np.float64).reshape(-1).tolist())


def _outcome(f, values) -> str:
    try:
        return repr(f(values))  # repr: the sign of a zero sum counts
    except (OverflowError, ValueError) as e:  # ValueError: fsum's -inf + inf
        return type(e).__name__


def _exact_total(values) -> float:
    """The exact sum of finite values, rounded once (int / int true division rounds correctly)."""
    from fractions import Fraction
    return float(sum(map(Fraction, values.tolist()), Fraction(0)))


def _same_sum(values) -> None:
    from ds4ref.gguf.tiny import exact_sum
    want = _outcome(_fsum, values)
    if want == "OverflowError" and np.isfinite(values).all():
        want = _outcome(_exact_total, values)  # fsum's running partials overflowed: the exact total's rounding
    assert _outcome(exact_sum, values) == want, (want, values)


scaled = st.tuples(st.floats(-2.0, 2.0), st.integers(-1080, 1030)).map(lambda t: t[0] * 2.0 ** max(t[1], -1074)
                                                                       if t[1] < 1024 else t[0] * 2.0 ** 1023)


@given(st.lists(st.one_of(st.floats(), scaled, st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 2.0 ** 1023])),
                max_size=40))
def test_exact_sum_is_fsum(values):
    """exact_sum is math.fsum, bit for bit and in its sign of zero, non-finite values and overflow
    included; each value is also summed with its negation (cancellation down to the last bit)."""
    _same_sum(np.array(values, np.float64))
    _same_sum(np.array(values + [-v for v in values[::2]] + [1e-300], np.float64))


@pytest.mark.parametrize("seed", [0, 1])
def test_exact_sum_is_fsum_across_its_steps(seed):
    """Sums of a few steps (_RUN values each) of values over every binade, each step's bincount
    sums near their largest."""
    from ds4ref.gguf.tiny import _RUN
    rng = np.random.default_rng(seed)
    n = 3 * _RUN + 17
    wide = rng.standard_normal(n) * np.exp2(rng.integers(-1074, 1000, n).astype(np.float64))
    _same_sum(wide)
    full = np.nextafter(np.ones(n), 2.0) * np.where(rng.random(n) < 0.5, -1.0, 1.0)  # every fraction bit set
    _same_sum(full)
    _same_sum(rng.standard_normal(n).astype(np.float32))


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q2_K", "Q4_K", "MXFP4"])
def test_random_blocks_are_the_bytes_of_the_fsum_statistics(monkeypatch, qtype):
    """The vectorised statistics write the bytes the former math.fsum ones wrote, at a size of
    several of exact_sum's steps (the policy files' goldens check their whole files)."""
    import math
    from ds4ref.gguf import tiny
    rng_state = 12345
    shape = (24, 4096)  # 98304 values: three steps

    def blocks():
        return tiny.random_blocks(np.random.default_rng(rng_state), qtype, shape, 0.02).data.tobytes()

    def fsum_mean(values):
        return _fsum(values) / values.size

    def fsum_std(values):
        x = np.asarray(values, np.float64).reshape(-1)
        d = x - fsum_mean(x)
        return math.sqrt(_fsum(d * d) / x.size)

    vectorised = blocks()
    monkeypatch.setattr(tiny, "exact_mean", fsum_mean)
    monkeypatch.setattr(tiny, "exact_std", fsum_std)
    assert blocks() == vectorised


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), qtype=st.sampled_from(["IQ2_XXS", "Q2_K", "Q4_K", "MXFP4"]),
       std=st.floats(1e-3, 10.0))
def test_random_blocks_are_valid(seed, qtype, std):
    """Random block bytes dequantise (through gguf.quants) to finite values of about the asked std."""
    import gguf
    from ds4ref.gguf.tiny import random_blocks
    blocks = random_blocks(np.random.default_rng(seed), qtype, (4, 512), std)
    assert blocks.qtype.name == qtype and blocks.data.dtype == np.uint8
    values = gguf.quants.dequantize(blocks.data, blocks.qtype)
    assert values.shape == (4, 512) and np.isfinite(values).all()
    # MXFP4's scale is a power of two: the asked std is rounded to one (a factor up to sqrt 2)
    # and every block's exponent is jittered by one (a factor 2), so its spread is wider
    spread = 2.0 * np.sqrt(2.0) if qtype == "MXFP4" else 2.0
    assert std / spread < values.std() < spread * std


def test_policy_cli_writes_the_policy(tmp_path):
    from ds4ref.gguf.file import open_gguf
    from ds4ref.gguf.tiny import main
    main(["--policy", "q2", "--out", str(tmp_path / "q2.gguf"), "--layers", "4"])
    f = open_gguf(tmp_path / "q2.gguf")
    assert f.metadata["ds4ref.tiny_policy"] == "q2" and f.config.n_layer == 4 and f.config.n_embd == 256
    assert f.tensor("blk.3.ffn_gate_exps.weight").qtype.name == "IQ2_XXS"
    assert f.tensor("blk.3.ffn_down_exps.weight").qtype.name == "Q2_K"
