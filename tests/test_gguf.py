"""GGUF reading/writing and the Weights interface."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from ds4ref.gguf.config import DS4Config
from ds4ref.gguf.file import GGUFError, open_gguf, write_gguf
from ds4ref.gguf.tensors import is_int_tensor, tensor_shapes
from ds4ref.gguf.tiny import random_tensors, tiny_config
from ds4ref.gguf.tokenizer import tiny_tokenizer_meta
from ds4ref.gguf.weights import DictWeights, WeightsError

# a small 3-layer config (ratios 0, 4, 128) so every test file stays tiny
CFG = tiny_config(n_layer=3, compress_ratios=[0, 4, 128], n_hash_layers=1)
MIXED = {"token_embd.weight": "f16", "output.weight": "q8_0", "blk.1.attn_q_b.weight": "bf16",
         "blk.2.ffn_down_exps.weight": "q8_0", "blk.1.ffn_gate_exps.weight": "f16",
         "blk.0.hc_attn_fn.weight": "f16"}


def expected_stored(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Reader-side values computed straight from gguf-py / NumPy, not through ds4ref."""
    if dtype == "f32":
        return arr.astype(np.float32)
    if dtype == "f16":
        return arr.astype(np.float16).astype(np.float32)
    qt = Q[dtype.upper()]
    return gguf.quants.dequantize(gguf.quants.quantize(arr.astype(np.float32), qt), qt)


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(CFG, seed=3)


@pytest.fixture(scope="module")
def written(tmp_path_factory, tensors):
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    write_gguf(path, CFG, tensors, tokenizer_meta=tiny_tokenizer_meta(CFG.vocab_size), dtypes=MIXED)
    return path


def raw_gguf(path, meta: dict, tensors: dict, arch: str = "deepseek4") -> None:
    """Write with GGUFWriter directly, bypassing write_gguf's checks (for bad files)."""
    w = gguf.GGUFWriter(str(path), arch)
    for k, (v, vt, sub) in meta.items():
        if k != "general.architecture":
            w.add_key_value(k, v, vt, sub)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def typed_meta(cfg: DS4Config) -> dict:
    out = {}
    for k, v in cfg.to_metadata().items():
        if isinstance(v, bool):
            out[k] = (v, V.BOOL, None)
        elif isinstance(v, list):
            out[k] = (v, V.ARRAY, V.INT32 if isinstance(v[0], int) else V.FLOAT32)
        elif isinstance(v, int):
            out[k] = (v, V.UINT32, None)
        elif isinstance(v, float):
            out[k] = (v, V.FLOAT32, None)
        else:
            out[k] = (v, V.STRING, None)
    return out


def plain_tensors(cfg: DS4Config) -> dict:
    return {n: a.astype(np.int32) if is_int_tensor(n) else a for n, a in random_tensors(cfg, 0).items()}


# ---------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------
def test_every_tensor_round_trips(written, tensors):
    w = open_gguf(written).weights()
    assert set(w.names()) == set(tensors)
    for name, arr in tensors.items():
        got = w.get(name)
        assert got.shape == tensor_shapes(CFG)[name], name
        if is_int_tensor(name):
            assert got.dtype == np.int32 and np.array_equal(got, arr), name
        else:
            assert got.dtype == np.float32
            assert np.array_equal(got, expected_stored(arr, MIXED.get(name, "f32"))), name


def test_f32_tensors_are_bit_exact(written, tensors):
    w = open_gguf(written).weights()
    name = "blk.2.attn_compressor_ape.weight"
    assert name not in MIXED
    assert w.get(name).tobytes() == tensors[name].astype(np.float32).tobytes()


def test_metadata_round_trips(written):
    f = open_gguf(written)
    want = {**CFG.to_metadata(), **tiny_tokenizer_meta(CFG.vocab_size)}
    for key, value in want.items():
        assert f.metadata[key] == value, key
    assert f.config == CFG


def test_metadata_uses_published_types(written):
    fields = gguf.GGUFReader(str(written)).fields
    p = "deepseek4."

    def types(key):
        return fields[key].types[0], fields[key].types[-1]

    assert types(p + "block_count") == (V.UINT32, V.UINT32)
    assert types(p + "expert_count") == (V.UINT32, V.UINT32)
    # u32, not u64: llama.cpp refuses u64 context lengths (tests/consumers.py)
    assert types(p + "context_length")[0] == V.UINT32
    assert types(p + "rope.scaling.original_context_length")[0] == V.UINT32
    assert types(p + "expert_gating_func")[0] == V.UINT32
    assert types(p + "rope.scaling.type")[0] == V.STRING
    assert types(p + "expert_weights_norm")[0] == V.BOOL
    assert types(p + "expert_weights_scale")[0] == V.FLOAT32
    assert types(p + "attention.layer_norm_rms_epsilon")[0] == V.FLOAT32
    assert types(p + "attention.compress_ratios") == (V.ARRAY, V.INT32)
    assert types(p + "swiglu_clamp_exp") == (V.ARRAY, V.FLOAT32)
    assert types("general.architecture")[0] == V.STRING
    assert types("tokenizer.ggml.token_type") == (V.ARRAY, V.INT32)
    assert types("tokenizer.ggml.bos_token_id")[0] == V.UINT32
    assert types("tokenizer.ggml.add_bos_token")[0] == V.BOOL


def test_header_parser_agrees_with_gguf_reader(written):
    """ds4ref parses headers itself (for speed); gguf-py's reader is the independent oracle."""
    reader = gguf.GGUFReader(str(written))
    f = open_gguf(written)
    keys = {k for k in reader.fields if not k.startswith("GGUF.")}
    assert keys == set(f.metadata)
    for key in keys:
        field = reader.fields[key]
        assert f.value_types[key] == (field.types[0], field.types[-1] if field.types[0] == V.ARRAY else None), key
        want = field.contents()
        if field.types[-1] == V.FLOAT32:  # ds4ref reports the shortest decimal of the stored f32
            assert np.array_equal(np.float32(f.metadata[key]), np.float32(want)), key
        else:
            assert f.metadata[key] == want, key
    assert [t.name for t in reader.tensors] == list(f.tensors)
    for t in reader.tensors:
        mine = f.tensors[t.name]
        assert mine.qtype == t.tensor_type and mine.offset == t.data_offset and mine.n_bytes == t.n_bytes
        assert mine.data.shape == t.data.shape and mine.data.tobytes() == np.asarray(t.data).tobytes(), t.name


def test_gguf_ne_is_reversed_numpy_shape(written):
    reader = gguf.GGUFReader(str(written))
    shapes = tensor_shapes(CFG)
    for t in reader.tensors:
        assert tuple(int(n) for n in t.shape) == tuple(reversed(shapes[t.name])), t.name
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["output.weight"] == Q.Q8_0 and types["blk.1.attn_q_b.weight"] == Q.BF16
    assert types["blk.0.ffn_gate_tid2eid.weight"] == Q.I32 and types["output_norm.weight"] == Q.F32


# ---------------------------------------------------------------------------
# Weights interface
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["blk.2.ffn_down_exps.weight", "blk.1.ffn_gate_exps.weight",
                                  "blk.0.ffn_up_exps.weight"])
def test_expert_reads_only_its_slice(written, name):
    w = open_gguf(written).weights()

    def no_full_read(n):
        raise AssertionError(f"expert() read the whole tensor {n}")

    w.file.read = no_full_read
    slices = [w.expert(name, e) for e in range(CFG.n_expert)]
    full = open_gguf(written).weights().get(name)
    for e, s in enumerate(slices):
        assert np.array_equal(s, full[e])
    assert w.expert(name, 1) is slices[1]  # cached


def test_expert_cache_is_bounded_when_asked(written):
    w = open_gguf(written).weights(max_cached_experts=2)
    for e in range(4):
        w.expert("blk.2.ffn_up_exps.weight", e)
    assert len(w._experts) == 2


def test_with_dtype_shares_file_and_widens(written):
    w32 = open_gguf(written).weights()
    w64 = w32.with_dtype(np.float64)
    assert w64.file is w32.file and w64.dtype is np.float64
    for name in ("output.weight", "blk.1.attn_q_b.weight", "blk.0.attn_sinks.weight"):
        assert w64.get(name).dtype == np.float64
        assert np.array_equal(w64.get(name), w32.get(name).astype(np.float64))
    assert w64.expert("blk.2.ffn_down_exps.weight", 3).dtype == np.float64
    assert w64.get("blk.0.ffn_gate_tid2eid.weight").dtype == np.int32


def test_returned_arrays_are_read_only(written):
    w = open_gguf(written).weights()
    with pytest.raises(ValueError):
        w.get("output_norm.weight")[0] = 0.0


def test_dict_weights_match_input(tensors):
    w = DictWeights(CFG, tensors, dtype=np.float64)
    assert w.get("blk.1.attn_kv.weight").dtype == np.float64
    assert np.array_equal(w.get("blk.1.attn_kv.weight"), tensors["blk.1.attn_kv.weight"].astype(np.float64))
    assert np.array_equal(w.expert("blk.1.ffn_gate_exps.weight", 5), tensors["blk.1.ffn_gate_exps.weight"][5])
    assert w.with_dtype(np.float32).get("output.weight").dtype == np.float32


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.pop("blk.1.indexer.proj.weight"), "missing tensor 'blk.1.indexer.proj.weight'"),
    (lambda t: t.__setitem__("output.weight", np.zeros((3, 4), np.float32)), "'output.weight' has NumPy shape (3, 4)"),
    (lambda t: t.__setitem__("blk.0.ffn_gate_tid2eid.weight", np.zeros((512, 2), np.float32)), "must hold integers"),
])
def test_dict_weights_reject_bad_tensors(tensors, mutate, message):
    bad = dict(tensors)
    mutate(bad)
    with pytest.raises(WeightsError) as err:
        DictWeights(CFG, bad)
    assert message in str(err.value)


def test_bad_requests_name_the_problem(tensors):
    w = DictWeights(CFG, tensors)
    with pytest.raises(WeightsError, match="unknown tensor 'blk.9.attn_kv.weight'"):
        w.get("blk.9.attn_kv.weight")
    with pytest.raises(WeightsError, match="not a per-expert tensor"):
        w.expert("output.weight", 0)
    with pytest.raises(WeightsError, match="expert index 8 out of range"):
        w.expert("blk.0.ffn_up_exps.weight", 8)
    with pytest.raises(WeightsError, match="float32 or float64"):
        DictWeights(CFG, tensors, dtype=np.float16)


# ---------------------------------------------------------------------------
# bad files
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [0.5, 0.999, 0.02, 10])
def test_truncated_file(tmp_path, written, keep):
    data = written.read_bytes()
    cut = int(len(data) * keep) if keep < 1 else keep
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(GGUFError, match="truncated"):
        open_gguf(bad)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_gguf(bad)
    with pytest.raises(GGUFError, match="no such file"):
        open_gguf(tmp_path / "absent.gguf")


def test_wrong_architecture(tmp_path):
    path = tmp_path / "llama.gguf"
    meta = typed_meta(CFG)
    raw_gguf(path, meta, plain_tensors(CFG), arch="llama")
    with pytest.raises(GGUFError, match="general.architecture is 'llama', expected 'deepseek4'"):
        open_gguf(path)


def test_missing_metadata_key(tmp_path):
    path = tmp_path / "nokey.gguf"
    meta = typed_meta(CFG)
    del meta["deepseek4.expert_count"]
    raw_gguf(path, meta, plain_tensors(CFG))
    with pytest.raises(GGUFError, match="missing GGUF metadata key 'deepseek4.expert_count'"):
        open_gguf(path)


def test_missing_tensor(tmp_path):
    path = tmp_path / "notensor.gguf"
    t = plain_tensors(CFG)
    del t["blk.2.attn_compressor_norm.weight"]
    raw_gguf(path, typed_meta(CFG), t)
    with pytest.raises(GGUFError, match="missing tensor 'blk.2.attn_compressor_norm.weight'"):
        open_gguf(path)


def test_wrong_shape(tmp_path):
    path = tmp_path / "shape.gguf"
    t = plain_tensors(CFG)
    t["blk.0.attn_sinks.weight"] = np.zeros(5, np.float32)
    raw_gguf(path, typed_meta(CFG), t)
    with pytest.raises(GGUFError, match=r"'blk.0.attn_sinks.weight' has NumPy shape \(5,\), expected \(4,\)"):
        open_gguf(path)


def _retype(path, name: str, type_id: int) -> None:
    # GGUFReader in r+ mode maps the header writable: patch one tensor's type id in place
    reader = gguf.GGUFReader(str(path), "r+")
    for t in reader.tensors:
        if t.name == name:
            t.field.parts[4][0] = type_id
            reader.data.flush()
            return
    raise AssertionError(name)


def test_unknown_type_id_names_tensor(tmp_path):
    path = tmp_path / "t101.gguf"
    raw_gguf(path, typed_meta(CFG), plain_tensors(CFG))
    _retype(path, "blk.1.attn_kv.weight", 101)
    with pytest.raises(GGUFError, match="'blk.1.attn_kv.weight' has GGML type id 101"):
        open_gguf(path)


def test_type_gguf_cannot_dequantise(tmp_path):
    path = tmp_path / "q81.gguf"
    raw_gguf(path, typed_meta(CFG), plain_tensors(CFG))
    _retype(path, "output_norm.weight", int(Q.Q8_1))  # fewer bytes than the f32 data: still in bounds
    with pytest.raises(GGUFError, match="'output_norm.weight' has GGML type Q8_1"):
        open_gguf(path)


def test_float_tensor_stored_as_int(tmp_path):
    path = tmp_path / "int.gguf"
    t = plain_tensors(CFG)
    t["output_norm.weight"] = np.ones(CFG.n_embd, np.int32)
    raw_gguf(path, typed_meta(CFG), t)
    with pytest.raises(GGUFError, match="'output_norm.weight' holds float values but is stored as I32"):
        open_gguf(path)


def test_writer_rejects_rows_that_do_not_fill_blocks(tmp_path):
    cfg = tiny_config(n_layer=1, compress_ratios=[0], n_hash_layers=0, head_dim=80, n_rot=16)
    with pytest.raises(GGUFError, match="'blk.0.attn_kv_a_norm.weight': row length 80 is not a multiple"):
        write_gguf(tmp_path / "x.gguf", cfg, random_tensors(cfg, 0),
                   dtypes={"blk.0.attn_kv_a_norm.weight": "q8_0"})
    with pytest.raises(GGUFError, match="unknown tensor dtype 'f8'"):
        write_gguf(tmp_path / "y.gguf", cfg, random_tensors(cfg, 0), default_dtype="f8")


HASHED = tiny_config(n_layer=3, compress_ratios=[0, 4, 128], n_hash_layers=2)


@pytest.mark.parametrize("backend", ["numpy", "hip"])
def test_a_hash_route_naming_an_expert_twice_is_refused_at_load_by_both_backends(tmp_path, backend):
    """The GPU expert kernels take distinct experts per token; the reference would compute the
    repeat. Both refuse the file at load (before any device is opened), naming layer and token."""
    import ds4ref
    tensors = random_tensors(HASHED, seed=5)
    table = tensors["blk.1.ffn_gate_tid2eid.weight"].copy()
    table[7, 1] = table[7, 0]
    tensors["blk.1.ffn_gate_tid2eid.weight"] = table
    path = tmp_path / "repeat.gguf"
    write_gguf(path, HASHED, tensors, tokenizer_meta=tiny_tokenizer_meta(HASHED.vocab_size))
    with pytest.raises(WeightsError, match=rf"{path}: layer 1's hash routing table 'blk.1.ffn_gate_tid2eid.weight' "
                                           rf"sends token 7 to expert {table[7, 0]} twice"):
        ds4ref.load(path, backend=backend)


def test_a_hash_route_outside_the_experts_is_refused():
    tensors = random_tensors(HASHED, seed=5)
    tensors["blk.0.ffn_gate_tid2eid.weight"][3, 1] = HASHED.n_expert
    w = DictWeights(HASHED, tensors)
    with pytest.raises(WeightsError, match=r"DictWeights: layer 0's hash routing table .* sends token 3 to expert 8, "
                                           r"outside 0..7"):
        w.check_hash_routes()


def test_distinct_hash_routes_load():
    import ds4ref.reference.model as ref
    m = ref.Model(DictWeights(HASHED, random_tensors(HASHED, seed=5)))
    assert m.weights.get("blk.1.ffn_gate_tid2eid.weight").shape == (HASHED.vocab_size, HASHED.n_expert_used)
