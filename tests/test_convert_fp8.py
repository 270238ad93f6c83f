"""The official FP8/FP4 checkpoint: a synthetic checkpoint in the official layout,
written by hand (safetensors header + raw bytes, no torch), converts; FP4 experts reach MXFP4
bit for bit and FP8 weights decode exactly (torch's float8 types are the oracle)."""
from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings, strategies as st

import ds4ref
from ds4ref.convert.to_gguf import ConvertError, convert
from ds4ref.convert.fp8 import fp4_to_mxfp4
from ds4ref.gguf.file import open_gguf
from ds4ref.convert.hf import config_to_hf, to_checkpoint_tensors
from ds4ref.gguf.tiny import random_tensors, tiny_config

CFG = tiny_config(n_layer=4, swiglu_clamp=[2.0] * 4)  # transformers: one clamp for all layers
# spec §2.7: E2M1 codes 0..15 (low nibble = even input index), value = table[code] * 2^(e-127)
E2M1_SPEC = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
FP8_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
                "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight")


def write_safetensors(path, tensors: dict) -> None:
    """{name: (safetensors dtype, shape, bytes)} -> a safetensors file (the format is a JSON header)."""
    header, blobs, at = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _fp8(rng, shape):
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (0x7F, 0xFF): 1.0 instead
    scale = rng.integers(118, 125, (-(-shape[0] // 128), -(-shape[1] // 128)), dtype=np.uint8)
    return codes, scale


def _fp4(rng, shape):
    packed = rng.integers(0, 256, (shape[0], shape[1] // 2), dtype=np.uint8)
    return packed, rng.integers(118, 128, (shape[0], shape[1] // 32), dtype=np.uint8)


def official_checkpoint(path, fp4_scale_override: int | None = None):
    """config.json + model.safetensors: FP8 attention/shared-expert weights (E4M3 + E8M0
    128x128 `.scale`), FP4 routed experts (I8 + E8M0 per 32 `.scale`), the rest F32."""
    rng = np.random.default_rng(5)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_to_hf(CFG, "legacy")))
    out, sources = {}, {}
    for name, arr in to_checkpoint_tensors(CFG, random_tensors(CFG, 0), names="official").items():
        if name.endswith(FP8_SUFFIXES) or name == "head.weight":
            codes, scale = _fp8(rng, arr.shape)
            out[name] = ("F8_E4M3", arr.shape, codes.tobytes())
            out[name.removesuffix(".weight") + ".scale"] = ("F8_E8M0", scale.shape, scale.tobytes())
            sources[name] = (codes, scale)
        elif ".ffn.experts." in name:
            packed, scale = _fp4(rng, arr.shape)
            if fp4_scale_override is not None:
                scale[0, 0] = fp4_scale_override
            out[name] = ("I8", packed.shape, packed.tobytes())
            out[name.removesuffix(".weight") + ".scale"] = ("F8_E8M0", scale.shape, scale.tobytes())
            sources[name] = (packed, scale)
        elif np.issubdtype(arr.dtype, np.integer):
            out[name] = ("I64", arr.shape, arr.astype("<i8").tobytes())
        else:
            out[name] = ("F32", arr.shape, arr.astype("<f4").tobytes())
    write_safetensors(path / "model.safetensors", out)
    return sources


def fp4_oracle(packed, scale) -> np.ndarray:
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
    return np.array(E2M1_SPEC)[codes] * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, 1)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    sources = official_checkpoint(d / "ck")
    convert(d / "ck", d / "m.gguf", "f32")
    return sources, open_gguf(d / "m.gguf"), d


def test_fp4_experts_become_mxfp4_bit_for_bit(converted):
    sources, f, _ = converted
    for il in range(CFG.n_layer):
        for w, gname in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
            name = f"blk.{il}.{gname}.weight"
            assert f.tensor(name).qtype == Q.MXFP4, name
            for e in (0, CFG.n_expert - 1):
                want = fp4_oracle(*sources[f"layers.{il}.ffn.experts.{e}.{w}.weight"])
                got = f.read_expert(name, e)
                assert np.array_equal(got.astype(np.float64), want), f"{name} expert {e}"


def test_fp8_weights_decode_exactly(converted):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch without float8_e8m0fnu")
    sources, f, _ = converted
    for src, gname in (("layers.1.attn.wq_b.weight", "blk.1.attn_q_b.weight"), ("head.weight", "output.weight"),
                       ("layers.3.ffn.shared_experts.w2.weight", "blk.3.ffn_down_shexp.weight")):
        codes, scale = sources[src]
        values = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
        s = torch.from_numpy(scale).view(torch.float8_e8m0fnu).float()
        s = s.repeat_interleave(128, 0)[:codes.shape[0]].repeat_interleave(128, 1)[:, :codes.shape[1]]
        assert f.tensor(gname).qtype == Q.F32
        assert np.array_equal(f.read(gname), (values * s).numpy()), gname


@pytest.mark.parametrize("dtype, qtype", [("bf16", Q.BF16), ("q8_0", Q.Q8_0)])
def test_dtype_applies_to_fp8_weights_and_the_model_runs(converted, dtype, qtype):
    _, _, d = converted
    out = d / f"m_{dtype}.gguf"
    convert(d / "ck", out, dtype)
    f = open_gguf(out)
    assert f.tensor("blk.1.attn_q_b.weight").qtype == qtype
    assert f.tensor("blk.1.ffn_gate_exps.weight").qtype == Q.MXFP4  # experts stay lossless
    logits = ds4ref.load(out).score([0, 3, 7, 11])
    assert np.isfinite(logits).all()


def test_nan_fp4_scale_refused(tmp_path):
    official_checkpoint(tmp_path / "ck", fp4_scale_override=255)
    with pytest.raises(ConvertError, match=r"tensor 'layers\.0\.ffn\.experts\.0\.w1\.weight'.*255 \(NaN\)"):
        convert(tmp_path / "ck", tmp_path / "m.gguf")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), groups=st.integers(1, 4))
def test_fp4_to_mxfp4_is_lossless(seed, rows, groups):
    """Any codes, any E8M0 scale 0..252: gguf-py's MXFP4 dequantisation gives the FP4 values exactly.
    (253 and 254 put 6 * 2^e beyond float32 in any float32 decoder; 255 is NaN and refused.)"""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (rows, groups * 16), dtype=np.uint8)
    scale = rng.integers(0, 253, (rows, groups), dtype=np.uint8)
    got = gguf.quants.dequantize(fp4_to_mxfp4(packed, scale, "t"), Q.MXFP4)
    assert np.array_equal(got.astype(np.float64), fp4_oracle(packed, scale))


def test_row_chunked_conversion_writes_the_same_file(converted, tmp_path, monkeypatch):
    """Large 2-D tensors are converted a block of rows at a time (bounded memory); the file is
    byte for byte the one whole-tensor conversion writes. Chunks of 128 rows and no size
    threshold make every 2-D float and FP8 tensor of the small checkpoint go that way."""
    from ds4ref.gguf import file as gguf_file
    _, _, d = converted
    whole = tmp_path / "whole.gguf"
    monkeypatch.setattr(gguf_file, "ROW_CHUNK_MIN_BYTES", 1 << 62)
    convert(d / "ck", whole, "q8_0")
    monkeypatch.setattr(gguf_file, "ROW_CHUNK_MIN_BYTES", 0)
    monkeypatch.setattr(gguf_file, "ROW_CHUNK", 128)
    written = []
    write_rows = gguf_file._write_rows
    monkeypatch.setattr(gguf_file, "_write_rows", lambda w, parts: write_rows(w, (written.append(p.nbytes) or p
                                                                               for p in parts)))
    parts = tmp_path / "parts.gguf"
    convert(d / "ck", parts, "q8_0")
    assert len(written) > 2 * CFG.n_layer  # FP8 and f32 matrices went in parts, some in several
    assert whole.read_bytes() == parts.read_bytes()


def test_bf16_and_f16_checkpoints_convert_exactly_without_torch(tmp_path):
    """The README's install (no torch) converts BF16 and F16 tensors, widened to float32 exactly:
    the GGUF equals the one converted from an F32 checkpoint of the same values."""
    narrow, wide = {}, {}
    for i, (name, arr) in enumerate(to_checkpoint_tensors(CFG, random_tensors(CFG, 0), names="official").items()):
        if np.issubdtype(arr.dtype, np.integer):
            narrow[name] = wide[name] = ("I64", arr.shape, arr.astype("<i8").tobytes())
            continue
        if i % 2:
            bits = (arr.astype("<f4").view("<u4") >> 16).astype("<u2")  # a bf16 value: the top half
            narrow[name], values = ("BF16", arr.shape, bits.tobytes()), (bits.astype("<u4") << 16).view("<f4")
        else:
            narrow[name], values = ("F16", arr.shape, arr.astype("<f2").tobytes()), arr.astype("<f2").astype("<f4")
        wide[name] = ("F32", arr.shape, values.tobytes())
    assert {d for d, _, _ in narrow.values()} == {"BF16", "F16", "I64"}
    files = []
    for tag, tensors in (("narrow", narrow), ("wide", wide)):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "config.json").write_text(json.dumps(config_to_hf(CFG, "legacy")))
        write_safetensors(tmp_path / tag / "model.safetensors", tensors)
        convert(tmp_path / tag, tmp_path / f"{tag}.gguf", "f32")
        files.append(open_gguf(tmp_path / f"{tag}.gguf"))
    names = list(files[0].tensors)
    assert names == list(files[1].tensors) and names
    for n in names:
        assert files[0].read(n).tobytes() == files[1].read(n).tobytes(), n
