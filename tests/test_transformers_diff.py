"""Differential test: ds4ref (numerics='plain') against transformers' DeepseekV4ForCausalLM.

Both sides read the same random tiny checkpoint, written by ds4ref.convert.hf:
transformers loads it with from_pretrained (then float64, eager attention and
eager experts), ds4ref reads the GGUF that ds4ref.convert makes from it. So the
checkpoint writer, the converter, the GGUF reader and the math are all on the
path.

transformers keeps some internals in float32 even in a float64 model (RMSNorm,
the HC projection and Sinkhorn, RoPE tables, compressor softmax, indexer scores),
so agreement is ~1e-6 relative, not 1e-15; the bound is 1e-4.

The configs are chosen tie-free: top-k choices (indexer, router) are
broken by index in ds4ref and left to torch.topk in transformers, so a tie
could legitimately differ. Enough indexer heads make exact ReLU-zero ties of
indexer scores practically impossible, and every greedy step checks its own
top-1/top-2 margin so that a near tie fails loudly instead of flaking.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.deepseek_v4")

import ds4ref  # noqa: E402
from ds4ref.convert.to_gguf import convert  # noqa: E402
from ds4ref.convert.hf import export_checkpoint, load_hf_model  # noqa: E402
from ds4ref.gguf.tiny import random_tensors, tiny_config  # noqa: E402

REL_TOL = 1e-4
N_NEW = 6
TIE_MARGIN = 1e-5
HCA_RATIO = 128  # transformers also lets compress_rates change this; DS4Config allows only 4 and 128

# name -> (config overrides, weight seed, prompt length, checkpoint style (names, config keys, `model.` prefix))
CASES = {
    # Flash's schedule in small: two sliding layers, a CSA and an HCA layer.
    "flash-pattern": (dict(n_layer=4, swiglu_clamp=[2.0] * 4, sliding_window=16, indexer_top_k=8,
                           indexer_heads=8), 11, 400, ("hf", "modern", True)),
    # CSA/HCA from layer 0 (compress rope at layer 0), a sliding layer in between, one hash layer,
    # tiny window and top-k, 16 indexer heads, YaRN whose ramp falls inside the rope dims.
    "csa-first": (dict(n_layer=5, compress_ratios=[4, 128, 0, 4, 128], swiglu_clamp=[3.0] * 5, n_hash_layers=1,
                       n_embd=96, n_head=8, head_dim=128, n_rot=64, o_groups=4, o_lora_rank=32, q_lora_rank=48,
                       n_expert=6, n_expert_used=3, expert_ff=48, sliding_window=5, indexer_top_k=3,
                       indexer_heads=16, indexer_head_dim=64, hc_mult=3, hc_sinkhorn_iters=7, rms_eps=1e-5,
                       expert_weights_scale=2.5, rope_freq_base=5000.0, compress_rope_freq_base=40000.0,
                       yarn_factor=4.0, yarn_orig_ctx=256, yarn_beta_fast=16.0, yarn_beta_slow=2.0),
                  23, 390, ("official", "legacy", True)),
    # HCA first, two CSA layers, two hash layers, two HC streams, single routed expert per token.
    "narrow": (dict(n_layer=3, compress_ratios=[128, 4, 4], swiglu_clamp=[1.5] * 3, n_hash_layers=2,
                    n_embd=64, vocab_size=300, n_head=2, head_dim=96, n_rot=32, o_groups=1, o_lora_rank=48,
                    q_lora_rank=32, n_expert=4, n_expert_used=1, expert_ff=32, sliding_window=3,
                    indexer_top_k=5, indexer_heads=12, indexer_head_dim=32, hc_mult=2, hc_sinkhorn_iters=12),
               37, 420, ("hf", "legacy", False)),
    # Heads too small for official numerics' FP8/FP4 blocks (16 non-RoPE dims, indexer key
    # length 16): plain numerics and the converter take any shape transformers takes.
    "small-heads": (dict(n_layer=3, compress_ratios=[0, 4, 128], swiglu_clamp=[2.0] * 3, n_hash_layers=1,
                         n_embd=64, n_head=4, head_dim=32, n_rot=16, o_groups=2, o_lora_rank=24, q_lora_rank=32,
                         expert_ff=32, sliding_window=8, indexer_top_k=4, indexer_heads=16, indexer_head_dim=16),
                    41, 400, ("hf", "modern", True)),
}


class Pair:
    """One case: the config, the prompt, and both models."""

    def __init__(self, tmp_path, case: tuple):
        overrides, seed, length, (names, style, prefix) = case
        self.cfg = tiny_config(context_length=1 << 20, **overrides)
        tensors = random_tensors(self.cfg, seed)
        ck = export_checkpoint(tmp_path / "ck", self.cfg, tensors, names=names, config_style=style, prefix=prefix)
        convert(ck, tmp_path / "m.gguf")
        self.ours = ds4ref.load(tmp_path / "m.gguf", numerics="plain", dtype=np.float64)
        self.hf = load_hf_model(ck, torch.float64)
        self.ids = np.random.default_rng(seed).integers(0, self.cfg.vocab_size, length)

    def hf_logits(self, ids, **kw) -> np.ndarray:
        with torch.no_grad():
            return self.hf(torch.tensor(np.asarray(ids))[None], use_cache=False, **kw).logits[0].numpy()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    torch.set_num_threads(1)  # the CI box is shared; these models are too small to gain from threads
    return Pair(tmp_path_factory.mktemp(request.param), CASES[request.param])


def rel_err(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """‖Δ‖/‖ref‖ per position."""
    return np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


def test_case_exercises_the_features(pair):
    """Guard the guards: each prompt crosses >= 3 HCA windows and makes the indexer choose."""
    cfg, t = pair.cfg, len(pair.ids)
    assert t > 3 * HCA_RATIO and HCA_RATIO in cfg.compress_ratios and 4 in cfg.compress_ratios
    assert t // 4 > cfg.indexer_top_k  # more compressed rows than the indexer keeps
    assert cfg.sliding_window < t


def test_all_position_logits(pair):
    ref = pair.hf_logits(pair.ids)
    ours = pair.ours.score(pair.ids)
    err = rel_err(ours, ref)
    print(f"\n{pair.cfg.n_layer} layers, ratios {list(pair.cfg.compress_ratios)}: max rel {err.max():.2e} "
          f"at position {err.argmax()} of {len(err)}")
    assert err.max() < REL_TOL, _diagnose(pair, err)


def test_greedy_matches_transformers_full_forward(pair):
    """ds4ref's streamed decode vs transformers' full forward re-run at every step."""
    prompt = list(pair.ids)
    ours = pair.ours.generate(prompt, N_NEW)
    seq = list(prompt)
    for step in range(N_NEW):
        logits = pair.hf_logits(seq)[-1]
        top2 = np.sort(logits)[-2:]
        # ~10x the observed ds4ref/transformers difference (~1e-6 of the norm): below it, argmax is a coin flip.
        assert top2[1] - top2[0] > TIE_MARGIN * np.linalg.norm(logits), \
            f"step {step}: near tie in transformers' logits ({top2}); pick another seed"
        seq.append(int(np.argmax(logits)))
    assert ours == seq[len(prompt):]


def test_transformers_cached_decode_matches_its_full_forward(pair):
    """transformers' own generate (with its compressor cache) on these tie-free configs.

    If this fails while the full-forward test passes, transformers' cache is at fault,
    not ds4ref (see docs/convert.md on ties).
    """
    ids = torch.tensor(pair.ids)[None]
    with torch.no_grad():
        # An explicit all-ones mask: otherwise generate() treats prompt tokens equal to
        # pad_token_id as padding and shifts the positions of everything after them.
        out = pair.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                               min_new_tokens=N_NEW, do_sample=False, pad_token_id=pair.cfg.eos_id)
    ours = pair.ours.generate(list(pair.ids), N_NEW)
    assert out[0, len(pair.ids):].tolist() == ours


def _diagnose(pair, err: np.ndarray) -> str:
    """First position over tolerance and the first layer whose streams already differ."""
    from ds4ref.reference import prefill
    from ds4ref.numerics.tables import Tables
    from ds4ref.reference.layers import LayerWeights, embed

    bad = int(np.nonzero(err >= REL_TOL)[0][0])
    ids = pair.ids[: bad + 1]
    with torch.no_grad():
        hs = pair.hf(torch.tensor(ids)[None], use_cache=False, output_hidden_states=True).hidden_states
    w, cfg = pair.ours.weights, pair.cfg
    tables = Tables.build(cfg, w.dtype)
    streams = embed(w, ids, cfg)
    lines = [f"first position over {REL_TOL}: {bad} (rel {err[bad]:.2e})"]
    # hidden_states[i] is layer i's input streams (i < n_layer); the last entry is the head's normed input.
    for il in range(1, cfg.n_layer):
        lw = LayerWeights(w, il - 1, "plain")
        streams = prefill.attention_block(lw, cfg, tables, "plain", il - 1, streams)
        streams = prefill.ffn_block(lw, cfg, il - 1, streams, ids)
        e = rel_err(streams[bad].ravel(), hs[il][0, bad].numpy().ravel())
        lines.append(f"after layer {il - 1} (ratio {cfg.ratio(il - 1)}): streams rel {e:.2e}")
    return "\n".join(lines)
