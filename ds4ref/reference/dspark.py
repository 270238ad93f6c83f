"""DSpark block drafting (docs/mtp.md, "DSpark"): from the target's hidden states up to position
p and the token t at p + 1, one pass of the draft proposes the block_size tokens after t.

Formulas of the official inference code (DeepSeek-V4-Flash-0731 inference/model.py: DSparkBlock,
DSparkAttention, get_dspark_topk_idxs, DSparkMarkovHead, DSparkConfidenceHead, Transformer):
  H_q = [mean_k S^(l)_q[k] for l in target_layers]   the target's streams after those layers
  m_q = main_norm(main_proj(H_q))                     stage 0's weights, read by every stage
  K_s(q) = fp8(rope_q(kv_norm_s(W_kv,s m_q)))         stage s's window row of context position q
  x = embed([t, noise, ..., noise]) on every stream   the block at positions p + 1 .. p + B
  for each stage s: x = Block_s(x), whose attention lets every block row see the window rows
      K_s(max(0, p - W + 1) .. p) and all B block rows (its own projections; no causal mask)
  h = hc_head(x) (the last stage's), base = output(norm(h))   the target's output matrix
  d_0 = t; for i in 0..B-1: e_i = markov_w1[d_i], logits_i = base_i + markov_w2 e_i,
      d_{i+1} = argmax logits_i                        left to right, each on the draft before
  confidence_i = conf_proj . [h_i ; e_i]               a logit per drafted token
The blocks run through the main layers' own pieces (hc, project_qkv, attention_output,
ffn_block), so every product and norm is the canonical one. The block's rows never enter the
window: only context rows (fed ones) do, so a draft leaves no state behind.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gguf.dspark_file import DSparkWeights
from ..gguf.weights import WeightsError
from . import ops
from .layers import LayerWeights, attention_output, embed, ffn_block, hc, product_weight, project_qkv
from .mtp import MTPState


class DSparkState(MTPState):
    """Per-sequence state of the draft: each stage's window ring of context rows; `position`
    is the next context position to feed (the anchor's position when drafting)."""


@dataclass
class DraftBlock:
    """One draft per sequence: tokens (n, B), the biased logits they were chosen from
    (n, B, vocab), the confidence logits (n, B)."""
    tokens: np.ndarray
    logits: np.ndarray
    confidence: np.ndarray


class DSpark:
    """The draft over a target reference Model (shared embedding, output matrix, RoPE tables,
    numerics) and its DSparkWeights (gguf.dspark_file): `config` the draft's settings,
    `stages` its blocks' config."""

    def __init__(self, model, weights: DSparkWeights) -> None:
        sc, cfg = weights.config, model.config
        if (sc.n_embd, sc.hc_mult, sc.vocab_size) != (cfg.n_embd, cfg.hc_mult, cfg.vocab_size):
            raise WeightsError(f"{weights.where}: DSpark of width {sc.n_embd} x {sc.hc_mult} streams, vocab "
                               f"{sc.vocab_size}, for a model of {cfg.n_embd} x {cfg.hc_mult}, vocab {cfg.vocab_size}")
        self.model, self.config, self.stages = model, weights.dspark, sc
        self.weights = weights if weights.dtype == model.dtype else weights.with_dtype(model.dtype)

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose stream means the draft reads (Model.step_rows(taps=...))."""
        return self.config.target_layers

    def new_state(self) -> DSparkState:
        return DSparkState(self.stages, self.model.dtype)

    def _stage(self, s: int) -> LayerWeights:
        return LayerWeights(self.weights, s, self.model.numerics, prefix=f"mtp.{s}.")

    def feed(self, states, hidden: np.ndarray, positions) -> None:
        """Context rows: row i is the target's tapped hidden[i] (N, T*d) of positions[i], into
        states[i]; a sequence's rows consecutive from its state's position, in order."""
        positions = np.asarray(positions, np.int64)
        width = len(self.taps) * self.stages.n_embd
        hidden = np.asarray(hidden)
        if hidden.shape != (len(states), width) or hidden.dtype != self.model.dtype:
            raise ValueError(f"hidden must be {self.model.dtype.__name__} of shape {(len(states), width)}, "
                             f"got {hidden.dtype} {hidden.shape}")
        for st, pos in zip(states, positions):
            if pos != st.position:
                raise ValueError(f"DSpark context row at position {int(pos)}, but the state is at {st.position}")
            st.position += 1
        if not ops.batch_invariant(self.model.dtype) and len(states) > 1:
            for i in range(len(states)):
                self._feed(states[i:i + 1], hidden[i:i + 1], positions[i:i + 1])
            return
        self._feed(states, hidden, positions)

    def _feed(self, states, hidden, positions) -> None:
        sc, numerics = self.stages, self.model.numerics
        first = self._stage(0)
        main_x = ops.rmsnorm(ops.linear(hidden, first.matrix("main_proj.weight")), first["main_norm.weight"],
                             sc.rms_eps)
        cos, sin = ops.rope_cos_sin(self.model.tables.omega(0), positions, main_x.dtype)
        for s in range(self.config.n_stages):
            lw = self._stage(s)
            kv = ops.rmsnorm(ops.linear(main_x, lw.matrix("attn_kv.weight")), lw["attn_kv_a_norm.weight"], sc.rms_eps)
            kv = ops.rope(kv, cos, sin)
            if numerics == "official":
                kv = ops.fp8sim(kv, sc.n_rot)
            for st, pos, row in zip(states, positions, kv):
                st.put_raw(s, int(pos), row)

    def draft(self, states, anchors) -> DraftBlock:
        """A block per sequence: anchors[i] (the token after its last context row) at
        states[i].position, then the noise tokens. The states are read, not changed."""
        anchors = np.asarray(anchors, np.int64)
        if len(anchors) != len(states):
            raise ValueError(f"{len(states)} states and {len(anchors)} anchors")
        for st in states:
            if st.position == 0:
                raise ValueError("DSpark drafts after at least one context row (the official code asserts "
                                 "start_pos > 0)")
        if not ops.batch_invariant(self.model.dtype) and len(states) > 1:
            parts = [self._draft(states[i:i + 1], anchors[i:i + 1]) for i in range(len(states))]
            return DraftBlock(*(np.concatenate([getattr(p, f) for p in parts])
                                for f in ("tokens", "logits", "confidence")))
        return self._draft(states, anchors)

    def _draft(self, states, anchors) -> DraftBlock:
        dc, sc, numerics, model = self.config, self.stages, self.model.numerics, self.model
        n, B = len(states), dc.block_size
        tokens = np.full((n, B), dc.noise_token_id, np.int64)
        tokens[:, 0] = anchors
        tokens = tokens.reshape(-1)
        positions = (np.array([st.position for st in states], np.int64)[:, None] + np.arange(B)).reshape(-1)
        x = embed(model.weights, tokens, model.config)
        cos, sin = ops.rope_cos_sin(model.tables.omega(0), positions, x.dtype)
        for s in range(dc.n_stages):
            lw = self._stage(s)
            u, post, comb = hc(lw, "attn", sc, x)
            _, _, q, kv = project_qkv(lw, sc, u)
            q = ops.rope(q, cos[:, None, :], sin[:, None, :])
            kv = ops.rope(kv, cos, sin)
            if numerics == "official":
                kv = ops.fp8sim(kv, sc.n_rot)
            keys = []
            for i, st in enumerate(states):
                window = st.raw_rows(s, st.position - 1)
                keys += [[window, kv[i * B:(i + 1) * B]]] * B
            o = ops.attention_rows(q, keys, lw["attn_sinks.weight"])
            x = ops.hc_post(x, attention_output(lw, sc, o, cos, sin), post, comb)
            x = ffn_block(lw, sc, s, x, tokens)
        last = self._stage(dc.n_stages - 1)
        h = ops.hc_head(x, last.matrix("hc_head_fn.weight"), last["hc_head_base.weight"],
                        last["hc_head_scale.weight"], sc.rms_eps, sc.hc_eps)
        base = ops.linear(ops.rmsnorm(h, last["norm.weight"], sc.rms_eps),
                          product_weight(model.weights, "output.weight", numerics)).reshape(n, B, -1)
        w1, w2 = last["markov_head.markov_w1.weight"], last.matrix("markov_head.markov_w2.weight")
        drafts, logits, markov = np.zeros((n, B), np.int64), np.empty_like(base), []
        prev = anchors
        for i in range(B):
            e = w1[prev]
            logits[:, i] = base[:, i] + ops.linear(e, w2)
            prev = drafts[:, i] = np.argmax(logits[:, i], axis=-1)  # lower index wins ties
            markov.append(e)
        feat = np.concatenate([h.reshape(n, B, -1), np.stack(markov, axis=1)], axis=-1)
        confidence = ops.linear(feat.reshape(n * B, -1), last.matrix("confidence_head.proj.weight"))
        return DraftBlock(drafts, logits, confidence.reshape(n, B))
