"""ds4ref's DeepSeek-V4-Flash-0731 files in llama.cpp: the llama.cpp that llama-cpp-python 0.3.36
vendors loads the 0731 model files ds4ref writes (its logits, and its layer inputs at the draft's
`dflash.target_layers`, stay within the llama.cpp differential's tolerance of ds4ref's logits and
DSpark taps) and the DSpark draft as llama.cpp's `dflash` file, which it runs as a `draft-dspark`
draft the way common/speculative.cpp does (a draft context sharing the target's embedding and
output through `ctx_other`, context rows injected as target features, then one block of the anchor
and the mask token); its draft tokens, logits and confidences from ds4ref's own taps stay within
the same tolerance of ds4ref's (reference/dspark.py, plain numerics in float64).

Why not bits: llama.cpp is a foreign engine (float32, f16 rounding of its raw KV rows, ggml's
quantisation of activations for quantised matrices), and it skips the FP8 round trip of the context
rows that official numerics take (docs/mtp.md "DSpark"), which plain numerics skip as well. Its
block attention masks the window per query position, so the comparison keeps the context to at
most W - B rows, where every block row sees the whole context as in the official code; past that
llama.cpp's later block rows see fewer window rows, which the last test pins.

Needs llama-cpp-python 0.3.36 installed (pip builds llama.cpp from source); skipped without it."""
from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import numpy as np
import pytest

import ds4ref
import test_llama_cpp
from ds4ref.gguf.tiny import tiny_0731_config, write_tiny
from test_llama_cpp import FLOAT, QUANTISED, L, LlamaCpp, _agreement

pytestmark = getattr(test_llama_cpp, "pytestmark", [])  # skipped as that file is, for the same reasons
POSITIONS = 64


def _ext(name: str, argtypes, restype):
    """A function of llama.cpp's staging header (src/llama-ext.h), which llama-cpp-python's
    llama_cpp_ext leaves unbound: C++ linkage, so its symbol is the Itanium-mangled name."""
    f = getattr(L.llama_cpp._lib, name)
    f.argtypes, f.restype = argtypes, restype
    return f


class DSparkLlamaCpp(LlamaCpp):
    """A 0731 target and its dflash draft in llama.cpp, driven as common/speculative.cpp's
    `common_speculative_impl_draft_dflash` drives them, from llama-cpp-python's C API."""

    def __init__(self):
        super().__init__()
        p = ctypes.c_void_p
        self.set_layer_inp = _ext("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                                  [p, ctypes.c_uint32, ctypes.c_bool], None)
        self.get_layer_inp = _ext("_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                                  [p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))
        self.layer_ids = _ext("_Z28llama_model_target_layer_idsPK11llama_model", [p], ctypes.POINTER(ctypes.c_int32))
        self.n_layer_ids = _ext("_Z30llama_model_target_layer_ids_nPK11llama_model", [p], ctypes.c_uint32)
        self.set_nextn = _ext("_Z26llama_set_embeddings_nextnP13llama_contextbb", [p, ctypes.c_bool, ctypes.c_bool],
                              None)
        self.get_nextn = _ext("_Z26llama_get_embeddings_nextnP13llama_context", [p], ctypes.POINTER(ctypes.c_float))

    def load_draft(self, path):
        """The dflash file as llama.cpp's loader reads it (keys, tensor names, shapes): (model,
        the target layers it reads)."""
        self.log.clear()
        model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not model:
            raise RuntimeError(f"llama.cpp refuses {path}: " + "".join(l for l in self.log if "error" in l))
        return model, [self.layer_ids(model)[i] for i in range(self.n_layer_ids(model))]

    def round(self, model_path, draft_path, ids, features, width: int, block: int, noise: int):
        """(target logits of ids, its layer inputs at the draft's target layers, [per context
        length P: the draft's logits and sigmoid confidences of the block [ids[P], noise...] at
        positions P.. after context rows features[:P]]) for P = 1 .. len(features)."""
        model, ctx, nv = self.load(model_path)
        draft, layers = self.load_draft(draft_path)
        dctx = batch = None
        try:
            for lid in layers:
                self.set_layer_inp(ctx, lid, True)
            logits, taps = [], []
            for t in [(L.llama_token * 1)(t) for t in ids]:
                logits.append(self._logits(ctx, L.llama_batch_get_one(t, 1), nv))
                taps.append(np.concatenate([np.ctypeslib.as_array(self.get_layer_inp(ctx, lid), (width,)).copy()
                                            for lid in layers]))
            cp = L.llama_context_default_params()
            cp.type_k = cp.type_v = L.GGML_TYPE_F32
            cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
            cp.n_threads = cp.n_threads_batch = 2
            cp.ctx_other = ctx  # the draft has no token_embd / output: the target's
            dctx = L.llama_init_from_model(draft, cp)
            assert dctx, f"no llama.cpp draft context for {draft_path}: " + "".join(self.log[-5:])
            self.set_nextn(dctx, True, True)  # the confidences come back as nextn embeddings
            L.llama_set_causal_attn(dctx, False)
            batch, features = L.llama_batch_ext_init(dctx), np.ascontiguousarray(features, np.float32)
            blocks = []
            for P in range(1, len(features) + 1):
                # the last round's block rows sit in the draft's cache from P on: drop them, as the
                # driver does after verification, then inject context row P - 1 and draft
                L.llama_memory_seq_rm(L.llama_get_memory(dctx), 0, P - 1, -1)
                row = features[P - 1]
                self._process(dctx, batch, [(L.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1,
                                                          row.size), P - 1, False)])
                self._process(dctx, batch, [(ids[P] if i == 0 else noise, P + i, True) for i in range(block)])
                out = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(dctx, i), (nv,)) for i in range(block)])
                conf = np.ctypeslib.as_array(self.get_nextn(dctx), (block, width))[:, 0]  # broadcast along rows
                blocks.append((out.copy(), conf.copy()))
            return np.stack(logits), np.stack(taps), blocks
        finally:
            if batch:
                L.llama_batch_ext_free(batch)
            if dctx:
                L.llama_free(dctx)
            L.llama_free(ctx)
            L.llama_model_free(draft)
            L.llama_model_free(model)

    def _process(self, ctx, batch, rows) -> None:
        """One llama_process decode of rows (a token id or a llama_embd, position, output?)."""
        L.llama_batch_ext_clear(batch)
        for what, pos, out in rows:
            add = L.llama_batch_ext_add_embd if isinstance(what, L.llama_embd) else L.llama_batch_ext_add_token
            i = add(batch, 0, what)
            assert i >= 0 and L.llama_batch_ext_set_pos(batch, i, (L.llama_pos * 4)(pos, pos, pos, 0))
            L.llama_batch_ext_set_output_logits(batch, i, out)
        assert L.llama_process(ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0, "".join(self.log[-5:])


@pytest.fixture(scope="module")
def llama():
    return DSparkLlamaCpp()


def write_0731_files(d):
    """name -> (0731 model file, its dflash draft, bounds): every kind of 0731 file ds4ref writes,
    written into the folder d."""
    from checkpoint_0731 import checkpoint_0731
    from ds4ref.convert.to_gguf import convert
    write_tiny(d / "tiny.gguf", tiny_0731_config(), dspark=d / "dflash-tiny.gguf")
    write_tiny(d / "f32.gguf", tiny_0731_config(), dtypes={}, dspark=d / "dflash-f32.gguf")
    ck, _ = checkpoint_0731(d / "ck")
    convert(ck, d / "ck.gguf", "f32", dspark_out=d / "dflash-ck.gguf")  # its FP4 experts stay MXFP4
    return {"tiny --version 0731": (d / "tiny.gguf", d / "dflash-tiny.gguf", QUANTISED),
            "tiny --version 0731 --all-f32": (d / "f32.gguf", d / "dflash-f32.gguf", FLOAT),
            "convert 0731 --dtype f32": (d / "ck.gguf", d / "dflash-ck.gguf", QUANTISED)}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_0731_files(tmp_path_factory.mktemp("llama-cpp-0731"))


@pytest.fixture(scope="module")
def runs(llama, written):
    """kind -> Run, made once per kind: ds4ref's and llama.cpp's target pass over POSITIONS
    tokens, then a draft round after every context length P = 1 .. W + 1."""
    cache = {}

    def run(kind):
        if kind not in cache:
            cache[kind] = _run(llama, *written[kind])
        return cache[kind]
    return run


class Run(NamedTuple):
    ids: list[int]                   # the tokens
    taps: tuple[int, ...]            # ds4ref's tapped layers (official ids)
    layers: list[int]                # llama.cpp's target_layers, as its loader read them
    window: int                      # W - B: the longest context where llama.cpp's block sees OFF's window
    logits: tuple[np.ndarray, np.ndarray]   # (ds4ref's, llama.cpp's) target logits
    hidden: tuple[np.ndarray, np.ndarray]   # (ds4ref's taps, llama.cpp's layer inputs)
    blocks: list[tuple[Any, np.ndarray, np.ndarray]]  # per P: (ds4ref's DraftBlock, llama.cpp's logits, confidences)


def _run(llama, path, draft, _bounds) -> Run:
    model = ds4ref.load(path, numerics="plain", dtype=np.float64, dspark=draft)
    cfg, dspark = model.config, model.dspark
    ids = [cfg.bos_id] + np.random.default_rng(0).integers(10, cfg.vocab_size - 10, POSITIONS - 1).tolist()
    logits, taps = model.reference.step_rows([model.reference.new_state()] * POSITIONS, ids, np.arange(POSITIONS),
                                             taps=dspark.taps)
    rounds = cfg.sliding_window + 1
    state, ours = dspark.new_state(), []
    for P in range(1, rounds + 1):
        dspark.feed([state], taps[P - 1:P], [P - 1])
        ours.append(dspark.draft([state], [ids[P]]))
    their_logits, their_taps, theirs = llama.round(path, draft, ids, taps[:rounds], cfg.n_embd,
                                                   dspark.config.block_size, dspark.config.noise_token_id)
    return Run(ids, dspark.taps, [int(i) for i in llama.load_draft(draft)[1]],
               cfg.sliding_window - dspark.config.block_size, (logits, their_logits), (taps, their_taps),
               [(o, *t) for o, t in zip(ours, theirs)])


def _aligned(blocks):
    """(ds4ref's rows, llama.cpp's rows, |sigmoid confidence difference|s, whole blocks alike): a
    row is comparable while both Markov chains drafted the same tokens before it (a row's logits
    carry the bias of the draft before it); where the chains part the argmax shows it."""
    ours, theirs, conf, same = [], [], [], 0
    for blk, their, their_conf in blocks:
        drafted = their.argmax(axis=1)
        n = next((i + 1 for i in range(len(drafted)) if drafted[i] != blk.tokens[0, i]), len(drafted))
        ours.append(blk.logits[0, :n])
        theirs.append(their[:n])
        conf.append(np.abs(1 / (1 + np.exp(-blk.confidence[0, :n])) - their_conf[:n]))  # llama.cpp: sigmoid(c)
        same += n == len(drafted) and drafted[-1] == blk.tokens[0, -1]
    return np.concatenate(ours), np.concatenate(theirs), np.concatenate(conf), same


KINDS = ["tiny --version 0731", "tiny --version 0731 --all-f32", "convert 0731 --dtype f32"]


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_runs_the_0731_model_and_its_dspark_draft(runs, written, kind):
    run, (median, argmax) = runs(kind), written[kind][2]
    got = _agreement(*run.logits)
    assert got[0] <= median and got[1] >= argmax, f"{kind}: model file {got}"
    # llama.cpp reads the input of layer id + 1 (the last: the head's input), OFF the output of id
    assert run.layers == [t + 1 for t in run.taps]
    ours, theirs = run.hidden
    rel = np.median(np.abs(ours - theirs).max(axis=1) / np.abs(ours).max(axis=1))
    assert rel <= median, f"{kind}: target layer inputs {rel}"
    blocks = run.blocks[:run.window]
    ours, theirs, conf, same = _aligned(blocks)
    got = _agreement(ours, theirs)
    assert got[0] <= median and got[1] >= argmax, f"{kind}: DSpark drafts {got}"
    # the sigmoid is 1/4-Lipschitz: its differences stay under the confidence logits' own
    assert np.median(conf) <= median, f"{kind}: DSpark confidences {np.median(conf)}"
    assert same >= argmax * len(blocks), f"{kind}: {same} of {len(blocks)} blocks drafted alike"


def test_past_w_minus_b_context_rows_llama_cpp_masks_the_window(runs, written, monkeypatch):
    """llama.cpp's block rows take the sliding-window mask of their own positions: once the
    context holds more than W - B rows, the block row at position q sees only the context rows
    after q - W, where the official code shows every block row the last W. Every such round leaves
    the float files' tolerance, and ds4ref's draft with that mask in its attention comes back in."""
    from ds4ref.reference import dspark as module
    path, draft, _ = written["tiny --version 0731 --all-f32"]
    run, model = runs("tiny --version 0731 --all-f32"), ds4ref.load(path, numerics="plain", dtype=np.float64,
                                                                      dspark=draft)
    W, ids = model.config.sliding_window, run.ids
    official = module.ops.attention_rows

    def llama_cpp_mask(P):
        def attention_rows(q, keys, sinks):  # one sequence: row i is the block row at position P + i
            first = max(0, P - W)  # the window's first position (the state's raw_rows)
            return official(q, [[w[max(0, P + i - W + 1 - first):], b] for i, (w, b) in enumerate(keys)], sinks)
        return attention_rows

    state = model.dspark.new_state()
    model.dspark.feed([state] * run.window, run.hidden[0][:run.window], np.arange(run.window))
    for P, block in enumerate(run.blocks[run.window:], run.window + 1):
        model.dspark.feed([state], run.hidden[0][P - 1:P], [P - 1])
        ours, theirs, _, _ = _aligned([block])
        assert _agreement(ours, theirs)[0] > FLOAT[0], f"context of {P} rows"
        monkeypatch.setattr(module.ops, "attention_rows", llama_cpp_mask(P))
        masked = model.dspark.draft([state], [ids[P]])
        monkeypatch.setattr(module.ops, "attention_rows", official)
        ours, theirs, _, same = _aligned([(masked, *block[1:])])
        got = _agreement(ours, theirs)
        assert same == 1 and got[0] <= FLOAT[0] and got[1] == 1, f"context of {P} rows, llama.cpp's mask: {got}"
