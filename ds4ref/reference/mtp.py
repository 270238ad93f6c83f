"""The MTP block's forward (docs/mtp.md): draft logits for position p + 2 from the main
model's final streams at position p and the embedding of token p + 1.

Formulas of the official inference code (DeepSeek-V4-Flash inference/model.py, MTPBlock):
  e  = enorm(embed(t_{p+1}))                     embedding shared with the main model
  h  = hnorm(S_p[k]) for each stream k           S_p: the main model's streams before its head
  x[k] = e_proj(e) + h_proj(h[k])                the block's input streams
  x' = Block(x) at position p                    attention (the MTP layer's own KV state,
                                                 sliding window: ratio 0) + MoE, each with HC
  logits = output(norm(hc_head(x')))             the MTP's own hc_head_* and norm,
                                                 the main model's output projection
The block runs through the very code of the main layers (decode.block), as a one-layer model
of its own config (gguf.mtp.mtp_config), so every product and norm is the canonical one.
"""
from __future__ import annotations

import numpy as np

from ..gguf.mtp import PREFIX, MTPWeights
from ..gguf.weights import WeightsError
from . import ops
from .decode import Rows, block
from .layers import LayerWeights, head
from .state import SeqState


class MTPState(SeqState):
    """Per-sequence state of the MTP layer (its raw window ring), like a main layer's; save /
    load copy it whole (a window of rows), so speculation can roll rejected drafts back."""

    def save(self) -> tuple[np.ndarray, int]:
        return self.rings.copy(), self.position

    def load(self, snapshot: tuple[np.ndarray, int]) -> None:
        rings, self.position = snapshot
        self.rings[:] = rings


class MTP:
    """The MTP block over a main reference Model (shared embedding, output projection, RoPE
    tables and numerics) and its MTPWeights (gguf.mtp)."""

    def __init__(self, model, weights: MTPWeights) -> None:
        mcfg, cfg = weights.config, model.config
        if (mcfg.n_embd, mcfg.hc_mult, mcfg.vocab_size) != (cfg.n_embd, cfg.hc_mult, cfg.vocab_size):
            raise WeightsError(f"{weights.where}: MTP block of width {mcfg.n_embd} x {mcfg.hc_mult} streams, "
                               f"vocab {mcfg.vocab_size}, for a model of {cfg.n_embd} x {cfg.hc_mult}, "
                               f"vocab {cfg.vocab_size}")
        self.model, self.config = model, mcfg
        self.weights = weights if weights.dtype == model.dtype else weights.with_dtype(model.dtype)

    def new_state(self) -> MTPState:
        return MTPState(self.config, self.model.dtype)

    def rows(self, states, hidden: np.ndarray, tokens, positions) -> tuple[np.ndarray, np.ndarray]:
        """Row i: the main streams hidden[i] (hc, d) of position positions[i], token tokens[i]
        (the one at positions[i] + 1), into states[i]. Returns (draft logits (N, vocab),
        the MTP's output streams (N, hc, d), which a further draft step takes as its hidden)."""
        rows = Rows.of(states, tokens, positions)
        hidden = np.asarray(hidden)
        if hidden.shape != (len(rows), self.config.hc_mult, self.config.n_embd) or hidden.dtype != self.model.dtype:
            raise ValueError(f"hidden must be {self.model.dtype.__name__} of shape "
                             f"{(len(rows), self.config.hc_mult, self.config.n_embd)}, got {hidden.dtype} "
                             f"{hidden.shape}")
        if not ops.batch_invariant(self.model.dtype) and len(rows) > 1:
            parts = [self.rows(states[i:i + 1], hidden[i:i + 1], rows.tokens[i:i + 1], rows.positions[i:i + 1])
                     for i in range(len(rows))]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        return mtp_rows(self.model.weights, self.weights, self.model.tables, self.model.numerics, rows, hidden)

    def step(self, state: MTPState, hidden: np.ndarray, token: int, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """One draft: (logits (vocab,), streams (hc, d))."""
        logits, streams = self.rows([state], hidden[None], [int(token)], [int(pos)])
        return logits[0], streams[0]


def mtp_rows(main_weights, weights: MTPWeights, tables, numerics: str, rows: Rows, hidden: np.ndarray):
    cfg = weights.config
    n, hc, d = hidden.shape
    lw = LayerWeights(weights, 0, numerics, prefix=PREFIX)
    e = ops.rmsnorm(main_weights.get("token_embd.weight")[rows.tokens], lw["enorm.weight"], cfg.rms_eps)
    h = ops.rmsnorm(hidden.reshape(n * hc, d), lw["hnorm.weight"], cfg.rms_eps)
    x = ops.linear(h, lw.matrix("h_proj.weight")).reshape(n, hc, d) + ops.linear(e, lw.matrix("e_proj.weight"))[:, None]
    streams = block(lw, cfg, tables, numerics, rows, 0, x)
    mix = (lw.matrix("hc_head_fn.weight"), lw["hc_head_base.weight"], lw["hc_head_scale.weight"], lw["norm.weight"])
    return head(main_weights, cfg, numerics, streams, mix), streams
