"""ds4ref's files in llama.cpp: the llama.cpp that llama-cpp-python 0.3.36 vendors (its deepseek4
loader, src/models/deepseek4.cpp) loads every kind of file ds4ref writes, as written: the model
files (its logits stay within the llama.cpp differential's tolerance of ds4ref's) and the MTP
files (loaded for an MTP draft context, as llama.cpp's --mtp speculative decoding loads them; its
drafts from ds4ref's own main streams stay within the same tolerance of ds4ref's drafts).

Needs llama-cpp-python 0.3.36 installed (pip builds llama.cpp from source); skipped without it."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import ds4ref
from ds4ref.gguf.tiny import default_model_path, default_mtp_path, write_tiny

VERSION = "0.3.36"
try:
    import llama_cpp as L
except ImportError:
    L = None
if L is None:
    pytestmark = pytest.mark.skip(reason=f"llama-cpp-python {VERSION} is not installed (pip install "
                                         f"llama-cpp-python=={VERSION}; it builds llama.cpp from source)")
elif L.__version__ != VERSION:
    pytestmark = pytest.mark.skip(reason=f"llama-cpp-python {L.__version__} is installed; these tests read "
                                         f"{VERSION}'s llama.cpp, the one ds4ref targets")

POSITIONS = 64
# The llama.cpp differential's figures (benchmarks/llama_cpp_diff.py: docs/results/llama_cpp_diff.md,
# docs/gguf.md), ds4ref in plain float64 against llama.cpp: files of float matrices agree to the f16
# rounding of llama.cpp's raw KV rows (median relative difference 1.6e-3 to 1.8e-3, argmax 99.3 % and
# up), quantised ones to ggml's quantisation of activations (median 4.6e-2 to 6.0e-2, argmax 82.7 %
# and up). Bounds: (median relative difference at most, argmax agreement at least).
FLOAT, QUANTISED = (2e-3, 0.99), (6e-2, 0.80)


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: a model file's logits, one token a decode call,
    and an MTP file's drafts. Its log is kept, so a refusal says why."""

    def __init__(self):
        L.llama_backend_init()
        self.log: list[str] = []
        self._keep = L.llama_log_callback(lambda level, text, user: self.log.append(text.decode("utf-8", "replace")))
        L.llama_log_set(self._keep, ctypes.c_void_p())

    def load(self, path, mtp: bool = False):
        """(model, context, n_vocab) of a model file, or of an MTP file for an MTP draft context
        (llama_model_params.load_mtp, LLAMA_CONTEXT_TYPE_MTP: common/speculative.cpp's way)."""
        self.log.clear()
        mp = L.llama_model_default_params()
        mp.load_mtp = mtp
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise RuntimeError(f"llama.cpp refuses {path}: " + "".join(l for l in self.log if "error" in l))
        cp = L.llama_context_default_params()
        cp.type_k = cp.type_v = L.GGML_TYPE_F32
        cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
        cp.n_threads = cp.n_threads_batch = 2
        if mtp:
            cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        ctx = L.llama_init_from_model(model, cp)
        assert ctx, f"no llama.cpp context for {path}: " + "".join(self.log[-5:])
        return model, ctx, L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def _logits(self, ctx, batch, n_vocab) -> np.ndarray:
        assert L.llama_decode(ctx, batch) == 0, "".join(self.log[-5:])
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), (n_vocab,)).copy()

    def logits(self, path, ids) -> np.ndarray:
        model, ctx, nv = self.load(path)
        tokens = [(L.llama_token * 1)(t) for t in ids]  # a batch points into its token: keep them alive
        try:
            return np.stack([self._logits(ctx, L.llama_batch_get_one(t, 1), nv) for t in tokens])
        finally:
            L.llama_free(ctx)
            L.llama_model_free(model)

    def drafts(self, path, hidden: np.ndarray, tokens) -> np.ndarray:
        """Row p: the MTP's logits from the main streams hidden[p] at position p and tokens[p]; the
        MTP graph reads the token and the streams from one batch (its `embd`, hc x d floats)."""
        model, ctx, nv = self.load(path, mtp=True)
        width = hidden[0].size
        out = []
        try:
            for p, (h, t) in enumerate(zip(hidden, tokens)):
                b = L.llama_batch_init(1, width, 1)  # allocates embd; the token array is ours
                token = (L.llama_token * 1)(int(t))
                b.token = ctypes.cast(token, type(b.token))
                h = np.ascontiguousarray(h, np.float32).reshape(-1)
                ctypes.memmove(b.embd, h.ctypes.data, h.nbytes)
                b.n_tokens, b.pos[0], b.n_seq_id[0], b.seq_id[0][0], b.logits[0] = 1, p, 1, 0, 1
                try:
                    out.append(self._logits(ctx, b, nv))
                finally:
                    b.token = None
                    L.llama_batch_free(b)
        finally:
            L.llama_free(ctx)
            L.llama_model_free(model)
        return np.stack(out)


@pytest.fixture(scope="module")
def llama():
    return LlamaCpp()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (model file, its MTP file or None, bounds): every kind of file ds4ref writes."""
    from ds4ref.convert.to_gguf import convert
    from test_llama_cpp_convert import mtp_checkpoint
    from tests.golden.make_golden import policy_model
    d = tmp_path_factory.mktemp("llama-cpp")
    write_tiny(d / "f32.gguf", dtypes={}, mtp=d / "mtp-f32.gguf")
    out = {"packaged": (default_model_path(), default_mtp_path(), QUANTISED),
           "tiny --all-f32": (d / "f32.gguf", d / "mtp-f32.gguf", FLOAT)}
    out.update({f"tiny --policy {p}": (policy_model(p), None, QUANTISED) for p in ("q2", "q4", "mxfp4")})
    ck = mtp_checkpoint(d / "ck")
    for dtype in ("f32", "bf16", "q8_0"):  # the checkpoint's FP4 experts are MXFP4 whatever --dtype says
        convert(ck, d / f"ck-{dtype}.gguf", dtype, mtp_out=d / f"mtp-ck-{dtype}.gguf")
        out[f"convert --dtype {dtype}"] = (d / f"ck-{dtype}.gguf", d / f"mtp-ck-{dtype}.gguf", QUANTISED)
    return out


KINDS = ["packaged", "tiny --all-f32", "tiny --policy q2", "tiny --policy q4", "tiny --policy mxfp4",
         "convert --dtype f32", "convert --dtype bf16", "convert --dtype q8_0"]


def _agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(median over positions of max |ours - theirs| / max |ours|, argmax agreement)."""
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(ours).max(axis=1)
    return float(np.median(rel)), float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)))


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_runs_what_ds4ref_writes(llama, written, kind):
    path, mtp, (median, argmax) = written[kind]
    model = ds4ref.load(path, numerics="plain", dtype=np.float64, mtp=mtp)
    cfg = model.config
    ids = [cfg.bos_id] + np.random.default_rng(0).integers(10, cfg.vocab_size - 10, POSITIONS - 1).tolist()
    ours, hidden = model.reference.step_rows([model.reference.new_state()] * POSITIONS, ids, np.arange(POSITIONS),
                                             hidden=True)
    got = _agreement(ours, llama.logits(path, ids))
    assert got[0] <= median and got[1] >= argmax, f"{kind}: model file {got}"
    if mtp is None:
        return
    n = POSITIONS - 1
    drafts, _ = model.mtp.rows([model.mtp.new_state()] * n, hidden[:-1], ids[1:], np.arange(n))
    got = _agreement(drafts, llama.drafts(mtp, hidden[:-1], ids[1:]))
    assert got[0] <= median and got[1] >= argmax, f"{kind}: MTP file {got}"


def test_the_former_in_file_block_is_what_llama_cpp_refused(llama, tmp_path):
    """The regression this layout replaces: a model file carrying its MTP block as ds4ref wrote
    it before has tensors llama.cpp's loader does not create, and it refuses the file."""
    from test_mtp import in_file_layout
    with pytest.raises(RuntimeError, match="wrong number of tensors; expected 210, got 202"):
        llama.load(in_file_layout(tmp_path / "old.gguf"))
