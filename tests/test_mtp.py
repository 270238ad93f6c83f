"""The MTP block: its forward against float64 formulas, its GGUF layouts (llama.cpp's MTP file,
antirez's, and ds4ref's former in-file block), the main model's logits untouched, and clear
errors for bad MTP files (docs/mtp.md)."""
from __future__ import annotations

import numpy as np
import pytest

import ds4ref
from ds4ref.gguf.file import write_gguf, GGUFError
from ds4ref.gguf.mtp import PREFIX, MTPError, in_file_name, mtp_config, nextn_metadata
from ds4ref.gguf.tiny import (default_model_path, default_mtp_path, random_mtp, random_tensors, tiny_config,
                              tiny_dtypes, write_tiny)
from ds4ref.gguf.tokenizer import tiny_tokenizer_meta
from ds4ref.reference.decode import block
from ds4ref.reference.layers import LayerWeights
from ds4ref.reference.mtp import MTPState
from ds4ref.reference.state import SeqState
from official64 import hc_head, rms

IDS = [5, 77, 300, 12, 9, 401, 33, 250, 18, 64, 100, 7, 222, 91, 3, 480, 17, 58, 199, 2]


@pytest.fixture(scope="module")
def tiny():
    return ds4ref.load()


def _main_hidden(model, ids):
    st = model.reference.new_state()
    return model.reference.step_rows([st] * len(ids), ids, np.arange(len(ids)), hidden=True)


def _drafts(model, ids):
    logits, hidden = _main_hidden(model, ids)
    ms = model.mtp.new_state()
    return model.mtp.rows([ms] * (len(ids) - 1), hidden[:-1], ids[1:], np.arange(len(ids) - 1))


def _float64_mtp(model64, hidden, tokens):
    """The official MTPBlock formulas in float64, written out here for what is the MTP's own
    (enorm/hnorm, e_proj + h_proj per stream, hc_head with its own weights, norm, shared head);
    the block in between is the main layers' float64 code (tested against transformers)."""
    mw, cfg = model64.mtp.weights, model64.mtp.config
    g = lambda s: mw.get(PREFIX + s)
    eps = cfg.rms_eps
    e = rms(model64.weights.get("token_embd.weight")[tokens], g("enorm.weight"), eps)
    h = rms(hidden, g("hnorm.weight"), eps)
    x = np.einsum("nkd,od->nko", h, g("h_proj.weight")) + (e @ g("e_proj.weight").T)[:, None]
    states = [SeqState(cfg, np.float64)]
    out = []
    from ds4ref.reference.decode import Rows
    for i in range(len(tokens)):
        rows = Rows.of(states, [tokens[i]], [i])
        out.append(block(LayerWeights(mw, 0, model64.numerics, PREFIX), cfg, model64.reference.tables,
                         model64.numerics, rows, 0, x[i:i + 1]))
    s = hc_head(np.concatenate(out), g("hc_head_fn.weight"), g("hc_head_scale.weight"), g("hc_head_base.weight"),
                eps, cfg.hc_eps)
    y = rms(s, g("norm.weight"), eps)
    return y @ model64.weights.get("output.weight").T


@pytest.fixture(scope="module")
def all_f32(tmp_path_factory):
    """The tiny model and its MTP file with every tensor stored f32: official float32 products of
    block-quantised weights quantise their inputs to Q8 (canon.qlinear), which a float64 formula
    would not."""
    path = tmp_path_factory.mktemp("mtp") / "f32.gguf"
    write_tiny(path, dtypes={}, mtp=path.with_name("mtp-f32.gguf"))
    return path, path.with_name("mtp-f32.gguf")


@pytest.mark.parametrize("numerics", ["official", "plain"])
def test_float32_against_float64_formulas(numerics, all_f32):
    path, mtp = all_f32
    m32 = ds4ref.load(path, numerics=numerics, mtp=mtp)
    m64 = ds4ref.load(path, numerics=numerics, dtype=np.float64, mtp=mtp)
    _, hidden = _main_hidden(m32, IDS)  # both sides take the same main streams: the MTP alone is compared
    draft32, _ = m32.mtp.rows([m32.mtp.new_state()] * (len(IDS) - 1), hidden[:-1], IDS[1:], np.arange(len(IDS) - 1))
    ref = _float64_mtp(m64, hidden[:-1].astype(np.float64), np.asarray(IDS[1:]))
    # a tolerance only because one side is float64: the float32 side is the canonical arithmetic
    np.testing.assert_allclose(draft32, ref, rtol=2e-4, atol=2e-4)


def test_rows_at_once_equal_rows_one_by_one(tiny):
    draft, streams = _drafts(tiny, IDS)
    _, hidden = _main_hidden(tiny, IDS)
    ms = tiny.mtp.new_state()
    for p in range(len(IDS) - 1):
        lg, s = tiny.mtp.step(ms, hidden[p], IDS[p + 1], p)
        assert lg.tobytes() == draft[p].tobytes() and s.tobytes() == streams[p].tobytes()


def test_state_rolls_back(tiny):
    _, hidden = _main_hidden(tiny, IDS)
    ms = tiny.mtp.new_state()
    for p in range(5):
        tiny.mtp.step(ms, hidden[p], IDS[p + 1], p)
    snap = ms.save()
    first, _ = tiny.mtp.step(ms, hidden[5], IDS[6], 5)
    for p in range(6, 30):  # rejected drafts wrap the window
        tiny.mtp.step(ms, hidden[5], 11, p)
    ms.load(snap)
    again, _ = tiny.mtp.step(ms, hidden[5], IDS[6], 5)
    assert again.tobytes() == first.tobytes()


def test_main_file_carries_no_mtp_block(tmp_path, tiny):
    """The packaged model file is the model alone, byte for byte (llama.cpp's main file); its MTP
    block is found beside it."""
    write_tiny(tmp_path / "plain.gguf")
    assert (tmp_path / "plain.gguf").read_bytes() == default_model_path().read_bytes()
    bare = ds4ref.load(tmp_path / "plain.gguf")
    assert bare.mtp is None and tiny.mtp is not None
    assert f"MTP block from {default_mtp_path()}" in tiny.describe()
    assert bare.score(IDS).tobytes() == tiny.score(IDS).tobytes()


def _separate_file(path, cfg, tensors, drop=None, **meta):
    import gguf
    w = gguf.GGUFWriter(str(path), "deepseek4")
    for k, v in meta.items():
        w.add_uint32(k, v)
    for name, arr in tensors.items():
        if name != drop:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def _mtp_values(cfg, seed=0):
    from ds4ref.gguf.file import stored_values
    t, d = random_mtp(cfg, seed)
    return {n: stored_values(v, d.get(n, "f32"), n) for n, v in t.items()}


def test_separate_layout_gives_the_same_drafts(tmp_path, tiny):
    """antirez's file (mtp.0.* names) and llama.cpp's MTP file of the same stored values."""
    cfg = tiny.config
    _separate_file(tmp_path / "mtp.gguf", cfg, _mtp_values(cfg))
    sep = ds4ref.load(numerics="plain", mtp=tmp_path / "mtp.gguf")
    own = ds4ref.load(numerics="plain")
    a, b = _drafts(sep, IDS)[0], _drafts(own, IDS)[0]
    assert a.tobytes() == b.tobytes()  # plain numerics: both read the same stored values as floats
    assert "MTP block from" in sep.describe()


def test_mtp_file_round_trip(tiny):
    for name, v in _mtp_values(tiny.config).items():
        assert np.array_equal(tiny.mtp.weights.get(name), v), name


def test_mtp_file_is_llama_cpps_layout():
    """What llama.cpp's loader looks for (src/models/deepseek4.cpp, docs/mtp.md): the block as
    block N = n_layer, eh_proj = [e_proj | h_proj], the MTP's own hc head at the root names, the
    model's embedding and output beside it; block_count counts it, nextn_predict_layers = 1."""
    from ds4ref.gguf.file import MTPFile, encode_tensor
    from ds4ref.gguf.tensors import layer_tensor_shapes
    cfg, f = tiny_config(), MTPFile(default_mtp_path())
    n = cfg.n_layer
    want = {f"blk.{n}.{s}" for s in layer_tensor_shapes(mtp_config(cfg), 0)}
    want |= {f"blk.{n}.nextn.{s}.weight" for s in ("eh_proj", "enorm", "hnorm", "shared_head_norm")}
    want |= {f"output_hc_{s}.weight" for s in ("fn", "base", "scale")}
    want |= {"token_embd.weight", "output_norm.weight", "output.weight"}
    assert set(f.tensors) == want
    assert f.metadata["deepseek4.block_count"] == n + 1 and f.metadata["deepseek4.nextn_predict_layers"] == 1
    assert len(f.metadata["deepseek4.attention.compress_ratios"]) == n + 1
    t, d = random_mtp(cfg)
    eh = np.concatenate([t[PREFIX + "e_proj.weight"], t[PREFIX + "h_proj.weight"]], axis=1)
    assert np.asarray(f.tensor(f"blk.{n}.nextn.eh_proj.weight").data).tobytes() == \
        encode_tensor("eh", eh, "q8_0")[0].tobytes()
    assert np.array_equal(f.read("output_hc_fn.weight"), _mtp_values(cfg)[PREFIX + "hc_head_fn.weight"])
    main = ds4ref.load().weights
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        assert np.array_equal(f.read(name), main.get(name)), name


def test_mtp_file_is_not_a_model():
    with pytest.raises(GGUFError, match="is an MTP file .* give it beside its model"):
        ds4ref.load(default_mtp_path())


# ---- ds4ref's former layout: the block inside the model file ---------------------------------------------------

OLD_PACKAGED_SHA256 = "7279709eed72890e14ad9babe91a2a1e987e58d335173f5eb28908b76d860530"


def in_file_layout(path, cfg=None, seed=0, fused=False, drop=None):
    """A model file carrying its MTP block as its last block, as write_tiny wrote one from the MTP
    block's arrival until ds4ref wrote llama.cpp's MTP file (the packaged file of that time is this
    function's output with the defaults, OLD_PACKAGED_SHA256)."""
    cfg = cfg or tiny_config()
    t, d = random_mtp(cfg, seed)
    block = cfg.n_layer
    t = {in_file_name(n, block): v for n, v in t.items()}
    d = {in_file_name(n, block): v for n, v in d.items()}
    if fused:
        e, h = t.pop(f"blk.{block}.nextn.e_proj.weight"), t.pop(f"blk.{block}.nextn.h_proj.weight")
        t[f"blk.{block}.nextn.eh_proj.weight"] = np.concatenate([e, h], axis=1)
        d.pop(f"blk.{block}.nextn.h_proj.weight")
        d[f"blk.{block}.nextn.eh_proj.weight"] = d.pop(f"blk.{block}.nextn.e_proj.weight")
    if drop is not None:
        del t[drop]
    write_gguf(path, cfg, {**random_tensors(cfg, seed), **t}, tiny_tokenizer_meta(cfg.vocab_size),
               {**tiny_dtypes(cfg), **d}, extra_meta={"ds4ref.tiny_seed": seed, **nextn_metadata(cfg, mtp_config(cfg))})
    return path


def test_former_in_file_layout_still_reads(tmp_path, tiny):
    import hashlib
    old = ds4ref.load(in_file_layout(tmp_path / "old.gguf"))
    assert hashlib.sha256((tmp_path / "old.gguf").read_bytes()).hexdigest() == OLD_PACKAGED_SHA256
    assert "MTP block 6 skipped" in old.describe() and old.mtp is not None
    assert old.score(IDS).tobytes() == tiny.score(IDS).tobytes()
    assert _drafts(old, IDS)[0].tobytes() == _drafts(tiny, IDS)[0].tobytes()


def test_fused_eh_proj_accepted(tmp_path, tiny):
    fused = ds4ref.load(in_file_layout(tmp_path / "fused.gguf", fused=True))
    assert _drafts(fused, IDS)[0].tobytes() == _drafts(tiny, IDS)[0].tobytes()


def test_errors(tmp_path, tiny):
    cfg = tiny.config
    write_tiny(tmp_path / "plain.gguf")
    vals = _mtp_values(cfg)
    _separate_file(tmp_path / "missing.gguf", cfg, vals, drop=PREFIX + "hnorm.weight")
    with pytest.raises(MTPError, match="missing MTP tensor 'mtp.0.hnorm.weight'"):
        ds4ref.load(tmp_path / "plain.gguf", mtp=tmp_path / "missing.gguf")
    bad = dict(vals)
    bad[PREFIX + "e_proj.weight"] = np.zeros((4, 4), np.float32)
    _separate_file(tmp_path / "shape.gguf", cfg, bad)
    with pytest.raises(MTPError, match=r"'mtp.0.e_proj.weight' has NumPy shape \(4, 4\)"):
        ds4ref.load(tmp_path / "plain.gguf", mtp=tmp_path / "shape.gguf")
    _separate_file(tmp_path / "other.gguf", cfg, vals, **{"deepseek4.embedding_length": 4096})
    with pytest.raises(MTPError, match="belongs to another model"):
        ds4ref.load(tmp_path / "plain.gguf", mtp=tmp_path / "other.gguf")
    _separate_file(tmp_path / "none.gguf", cfg, {"x.weight": np.zeros(4)})
    with pytest.raises(MTPError, match="not an MTP GGUF: neither llama.cpp's layout .* nor antirez's"):
        ds4ref.load(tmp_path / "plain.gguf", mtp=tmp_path / "none.gguf")
    with pytest.raises(MTPError, match="carries its own MTP block"):
        ds4ref.load(in_file_layout(tmp_path / "old.gguf"), mtp=default_mtp_path())
    with pytest.raises(GGUFError, match="no such file"):
        ds4ref.load(tmp_path / "plain.gguf", mtp=tmp_path / "absent.gguf")
    with pytest.raises(MTPError, match="only 0"):
        mtp_config(cfg, ratio=4)


def test_llama_cpp_mtp_file_errors(tmp_path, tiny):
    """llama.cpp's MTP file for another model, or without one of its tensors, is refused naming
    what is wrong (the tensor by its llama.cpp name)."""
    from ds4ref.gguf.mtp import SHARED, write_mtp_gguf
    cfg = tiny.config
    main = random_tensors(cfg)
    tensors, shared = random_mtp(cfg)[0], {n: main[n] for n in SHARED}
    write_tiny(tmp_path / "four.gguf", tiny_config(n_layer=4), mtp=tmp_path / "mtp-four.gguf")
    with pytest.raises(MTPError, match="MTP block follows 4 layers, the model has 6: .* another model"):
        ds4ref.load(mtp=tmp_path / "mtp-four.gguf")
    import gguf
    r = gguf.GGUFReader(default_mtp_path())
    w = gguf.GGUFWriter(str(tmp_path / "part.gguf"), "deepseek4")
    for field in r.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in r.tensors:
        if t.name != "blk.6.nextn.hnorm.weight":
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(MTPError, match=r"missing MTP tensor 'blk\.6\.nextn\.hnorm\.weight'"):
        ds4ref.load(mtp=tmp_path / "part.gguf")
    with pytest.raises(MTPError, match="e_proj .* and h_proj .* must have one type"):
        write_mtp_gguf(tmp_path / "x.gguf", cfg, tensors, shared, dtypes={PREFIX + "e_proj.weight": "q8_0"})


def test_incomplete_in_file_block_leaves_the_model_without_mtp(tmp_path, tiny):
    """Auto-detected, an in-file block that does not fit is noted, not fatal (the main model runs,
    as llama.cpp loads such files); asked for strictly, the error names the tensor."""
    from ds4ref.gguf.file import open_gguf
    from ds4ref.gguf.mtp import in_file_mtp_strict
    path = in_file_layout(tmp_path / "part.gguf", drop=f"blk.{tiny.config.n_layer}.nextn.hnorm.weight")
    m = ds4ref.load(path)
    assert m.mtp is None and "MTP block not usable" in m.describe() and "nextn.hnorm.weight" in m.describe()
    assert m.score(IDS).tobytes() == tiny.score(IDS).tobytes()
    with pytest.raises(MTPError, match=r"missing MTP tensor 'blk\.6\.nextn\.hnorm\.weight'"):
        in_file_mtp_strict(open_gguf(path))
