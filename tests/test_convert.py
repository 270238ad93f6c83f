"""Checkpoint -> GGUF converter (ds4ref.convert) and the checkpoint writer (ds4ref.convert.hf)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ds4ref.convert.to_gguf import ConvertError, convert, main
from ds4ref.gguf.file import open_gguf, stored_values
from ds4ref.convert.hf import HFError, config_from_hf, config_to_hf, export_checkpoint
from ds4ref.gguf.tensors import tensor_shapes
from ds4ref.gguf.tiny import random_tensors, tiny_config

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _cfg(**kw):
    # transformers has a single swiglu_limit, so the HF-representable tiny model uses one clamp.
    base = dict(n_layer=4, swiglu_clamp=[2.0] * 4, context_length=1 << 20)
    base.update(kw)
    return tiny_config(**base)


@pytest.fixture(scope="module")
def model():
    cfg = _cfg()
    return cfg, random_tensors(cfg, seed=5)


def _same_config(a, b):
    # general.name comes from the directory name; everything else must round-trip.
    assert dataclasses.replace(a, name="x") == dataclasses.replace(b, name="x")


def _assert_same_tensors(path, cfg, tensors):
    f = open_gguf(path)
    _same_config(f.config, cfg)
    assert set(tensor_shapes(cfg)) <= set(f.tensors)
    for name, want in tensors.items():
        got = f.read(name)
        assert got.dtype == (np.int32 if name.endswith("tid2eid.weight") else np.float32), name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("names,style,prefix", [
    ("hf", "modern", True), ("hf", "legacy", False), ("official", "legacy", True), ("official", "modern", True)])
def test_round_trip(tmp_path, model, names, style, prefix):
    cfg, tensors = model
    export_checkpoint(tmp_path / "ck", cfg, tensors, names=names, config_style=style, prefix=prefix)
    convert(tmp_path / "ck", tmp_path / "m.gguf")
    _assert_same_tensors(tmp_path / "m.gguf", cfg, tensors)


@pytest.mark.parametrize("original_format", [True, False])
def test_round_trip_through_transformers_save(tmp_path, model, original_format):
    """What transformers itself writes (its hybrid 'original' names, or its own names) converts back."""
    from ds4ref.convert.hf import hf_model

    cfg, tensors = model
    hf_model(cfg, tensors, torch.float32).save_pretrained(tmp_path / "ck", save_original_format=original_format)
    convert(tmp_path / "ck", tmp_path / "m.gguf")
    _assert_same_tensors(tmp_path / "m.gguf", cfg, tensors)


def test_config_key_styles_agree(model):
    cfg, _ = model
    modern, legacy = config_to_hf(cfg, "modern"), config_to_hf(cfg, "legacy")
    assert "layer_types" in modern and "compress_ratios" not in modern
    assert "compress_ratios" in legacy and "layer_types" not in legacy
    _same_config(config_from_hf(modern), cfg)
    _same_config(config_from_hf(legacy), cfg)


def test_config_from_transformers_object(model):
    """transformers' own normalised config (legacy keys folded in) reads back the same."""
    from transformers import DeepseekV4Config

    cfg, _ = model
    d = config_to_hf(cfg, "legacy")
    hc = DeepseekV4Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    _same_config(config_from_hf(hc.to_dict()), cfg)


def test_legacy_ratios_may_carry_the_mtp_entry(model):
    cfg, _ = model
    d = config_to_hf(cfg, "legacy")
    d["compress_ratios"] = list(cfg.compress_ratios) + [0]  # published: one extra entry for the MTP layer
    assert config_from_hf(d).compress_ratios == cfg.compress_ratios


def test_missing_schedule_is_refused(model):
    cfg, _ = model
    d = config_to_hf(cfg, "legacy")
    del d["compress_ratios"]
    with pytest.raises(HFError, match="compression schedule"):
        config_from_hf(d)


def test_per_layer_clamps_are_not_representable():
    with pytest.raises(HFError, match="swiglu_limit"):
        config_to_hf(tiny_config(n_layer=4), "modern")  # the tiny model's clamps differ per layer


@pytest.mark.parametrize("dtype,qname", [("f16", "F16"), ("bf16", "BF16")])
def test_dtype_option(tmp_path, model, dtype, qname):
    cfg, tensors = model
    export_checkpoint(tmp_path / "ck", cfg, tensors)
    convert(tmp_path / "ck", tmp_path / "m.gguf", dtype=dtype)
    f = open_gguf(tmp_path / "m.gguf")
    for name, want in tensors.items():
        q = f.tensors[name].qtype.name
        if name.endswith("tid2eid.weight"):
            assert q == "I32"
        elif want.ndim == 1:
            assert q == "F32", name  # norms, HC biases/scales, sinks, router bias stay f32
        else:
            assert q == qname, name
            np.testing.assert_array_equal(f.read(name), stored_values(want, dtype), err_msg=name)


# ---- refusals -------------------------------------------------------------------------------

def _rewrite(ck, edit):
    """Load ck/model.safetensors as torch tensors, apply edit(dict), save it back."""
    path = ck / "model.safetensors"
    sd = safetensors_torch.load_file(str(path))
    edit(sd)
    safetensors_torch.save_file(sd, str(path))


@pytest.fixture
def official_ck(tmp_path, model):
    cfg, tensors = model
    return export_checkpoint(tmp_path / "ck", cfg, tensors, names="official", config_style="legacy")


def test_fp8_weight_without_scales_refused(tmp_path, official_ck):
    name = "layers.1.attn.wq_a.weight"

    def edit(sd):
        sd[name] = sd[name].to(torch.float8_e4m3fn)

    _rewrite(official_ck, edit)
    with pytest.raises(ConvertError, match=r"'layers\.1\.attn\.wq_a\.weight' is F8_E4M3 without its block scales"):
        convert(official_ck, tmp_path / "m.gguf")


def test_packed_fp4_experts_refused(tmp_path, official_ck):
    name = "layers.2.ffn.experts.3.w1.weight"

    def edit(sd):
        sd[name] = torch.zeros(sd[name].shape[0], sd[name].shape[1] // 2, dtype=torch.int8)

    _rewrite(official_ck, edit)
    with pytest.raises(ConvertError, match=r"'layers\.2\.ffn\.experts\.3\.w1\.weight'.*I8"):
        convert(official_ck, tmp_path / "m.gguf")


# A checkpoint edit and the refusal it must produce, naming the tensor.
BAD_CHECKPOINTS = {
    "scale companion, even in float": (
        lambda sd: sd.__setitem__("layers.0.attn.wkv.scale", torch.ones(1, 1)),
        r"'layers\.0\.attn\.wkv\.scale' is a quantisation scale"),
    "missing tensor": (
        lambda sd: sd.pop("layers.2.attn.compressor.wgate.weight"),
        r"missing tensors.*'blk\.2\.attn_compressor_gate\.weight'"),
    "missing expert": (
        lambda sd: sd.pop("layers.3.ffn.experts.5.w3.weight"),
        r"'blk\.3\.ffn_up_exps\.weight\[expert 5\]'"),
    # layer 0 is a sliding-window layer: a compressor there is a config/checkpoint mismatch
    "unexpected tensor": (
        lambda sd: sd.__setitem__("layers.0.attn.compressor.ape", torch.zeros(4, 192)),
        r"unexpected tensors.*'layers\.0\.attn\.compressor\.ape'"),
    "wrong shape": (
        lambda sd: sd.__setitem__("layers.1.attn.wkv.weight", torch.zeros(3, 3)),
        r"'layers\.1\.attn\.wkv\.weight' has shape \(3, 3\)"),
    # the same tensor under its official and its transformers name
    "duplicate spellings": (
        lambda sd: sd.__setitem__("model.layers.1.self_attn.sinks", sd["layers.1.attn.attn_sink"].clone()),
        "both map to 'blk.1.attn_sinks.weight'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoint_refused_naming_the_tensor(tmp_path, official_ck, case):
    edit, message = BAD_CHECKPOINTS[case]
    _rewrite(official_ck, edit)
    with pytest.raises(ConvertError, match=message):
        convert(official_ck, tmp_path / "m.gguf")


def test_incomplete_mtp_block_refused(tmp_path, model, official_ck):
    _rewrite(official_ck, lambda sd: sd.__setitem__("mtp.0.e_proj.weight", torch.zeros(4, 4)))
    with pytest.raises(ConvertError, match=r"mtp\.0\.\* .*missing tensors .*'blk\.4\.attn_kv\.weight'"):
        convert(official_ck, tmp_path / "m.gguf", mtp_out=tmp_path / "mtp.gguf")


def official_mtp(cfg, eh=None):
    """(the official checkpoint's mtp.0.* tensors of a random MTP block as arrays, the block by our
    names); eh, if given, maps e_proj's and h_proj's values (tests/test_llama_cpp_convert.py)."""
    from ds4ref.convert.hf import EXPERT_OFFICIAL, LAYER_NAMES
    from ds4ref.gguf.mtp import OWN, PREFIX
    from ds4ref.gguf.tiny import random_mtp
    ours, _ = random_mtp(cfg, 3)
    sd = {}
    for name, v in ours.items():
        suffix = name[len(PREFIX):]
        if suffix in EXPERT_OFFICIAL:
            for e in range(cfg.n_expert):
                sd[f"mtp.0.ffn.experts.{e}.{EXPERT_OFFICIAL[suffix]}.weight"] = v[e]
        elif suffix in OWN:
            key = suffix if suffix.endswith(("proj.weight", "norm.weight")) else suffix.removesuffix(".weight")
            sd["mtp.0." + key] = eh(v) if eh is not None and suffix in ("e_proj.weight", "h_proj.weight") else v
        else:
            sd["mtp.0." + LAYER_NAMES[suffix][0]] = v
    return sd, ours


def _official_mtp(cfg):
    """official_mtp's tensors as torch tensors, for a checkpoint rewrite."""
    sd, ours = official_mtp(cfg)
    return {k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, ours


def test_mtp_block_written_beside(tmp_path, model, official_ck):
    """mtp.0.* goes to llama.cpp's MTP file when asked for, and is left out otherwise, as
    llama.cpp's converter does with and without --mtp: the model file is the same bytes either
    way and carries neither the block nor nextn_predict_layers."""
    import ds4ref
    cfg, tensors = model
    sd_mtp, ours = _official_mtp(cfg)
    _rewrite(official_ck, lambda sd: sd.update(sd_mtp))
    convert(official_ck, tmp_path / "m.gguf", mtp_out=tmp_path / "mtp-m.gguf")
    convert(official_ck, tmp_path / "alone.gguf")
    _assert_same_tensors(tmp_path / "m.gguf", cfg, tensors)
    assert (tmp_path / "m.gguf").read_bytes() == (tmp_path / "alone.gguf").read_bytes()
    f = open_gguf(tmp_path / "m.gguf")
    assert set(f.tensors) == set(tensor_shapes(cfg)) and "deepseek4.nextn_predict_layers" not in f.metadata
    m = ds4ref.load(tmp_path / "m.gguf", mtp=tmp_path / "mtp-m.gguf")
    for name, v in ours.items():
        assert np.array_equal(m.mtp.weights.get(name), v), name


def test_mtp_cli(tmp_path, model, official_ck, capsys):
    cfg, _ = model
    _rewrite(official_ck, lambda sd: sd.update(_official_mtp(cfg)[0]))
    main(["--hf", str(official_ck), "--out", str(tmp_path / "m.gguf")])
    assert "left out the checkpoint's MTP block (mtp.0.*): --mtp-out FILE writes it" in capsys.readouterr().out
    main(["--hf", str(official_ck), "--out", str(tmp_path / "m.gguf"), "--mtp-out", str(tmp_path / "mtp.gguf")])
    assert "as llama.cpp's MTP file" in capsys.readouterr().out and (tmp_path / "mtp.gguf").is_file()


def test_mtp_out_without_an_mtp_block_refused(tmp_path, official_ck):
    with pytest.raises(ConvertError, match=r"no mtp\.0\.\* tensors: the checkpoint has no MTP block"):
        convert(official_ck, tmp_path / "m.gguf", mtp_out=tmp_path / "mtp.gguf")


def test_bad_config_named(tmp_path, official_ck):
    d = json.loads((official_ck / "config.json").read_text())
    d["scoring_func"] = "softmax"
    (official_ck / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConvertError, match="scoring_func"):
        convert(official_ck, tmp_path / "m.gguf")


def test_cli(tmp_path, model, official_ck, capsys):
    cfg, tensors = model
    main(["--hf", str(official_ck), "--out", str(tmp_path / "m.gguf")])
    assert "wrote" in capsys.readouterr().out
    _assert_same_tensors(tmp_path / "m.gguf", cfg, tensors)
    (official_ck / "config.json").unlink()
    with pytest.raises(SystemExit, match="no config.json"):
        main(["--hf", str(official_ck), "--out", str(tmp_path / "n.gguf")])


# ---- tokenizer ---------------------------------------------------------------------------------

def _tokenizer_json(meta: dict, drop_last: bool = False) -> dict:
    """A transformers tokenizer.json holding the tiny model's vocabulary (CONTROL tokens as special
    added tokens, USER_DEFINED ones as non-special added tokens, as DeepSeek's file has them)."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    n = len(tokens) - 1 if drop_last else len(tokens)
    vocab = {t: i for i, (t, k) in enumerate(zip(tokens[:n], types[:n])) if k not in (3, 4)}
    added = [{"id": i, "content": t, "special": k == 3} for i, (t, k) in enumerate(zip(tokens, types))
             if k in (3, 4)]
    return {"model": {"type": "BPE", "vocab": vocab, "merges": meta["tokenizer.ggml.merges"]},
            "added_tokens": added}


def test_tokenizer_converted(tmp_path, model, official_ck):
    from ds4ref.convert.to_gguf import _looks_special
    from ds4ref.gguf.tokenizer import Tokenizer, tiny_tokenizer_meta

    cfg, _ = model
    meta = tiny_tokenizer_meta(cfg.vocab_size)
    (official_ck / "tokenizer.json").write_text(json.dumps(_tokenizer_json(meta)), encoding="utf-8")
    (official_ck / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    convert(official_ck, tmp_path / "m.gguf")
    got = open_gguf(tmp_path / "m.gguf").metadata
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id"):
        assert got[key] == meta[key], key
    # added tokens that look like `<｜…｜>` are CONTROL in the converted file, as llama.cpp's converter
    # types them; the others keep the checkpoint's flag
    want = [3 if k == 4 and _looks_special(t) else k
            for t, k in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])]
    assert got["tokenizer.ggml.token_type"] == want
    assert got["tokenizer.chat_template"] == "{{ x }}"
    text = "Ada Lovelace wrote the first program."
    assert Tokenizer.from_gguf(got).encode(text) == Tokenizer.from_gguf(meta).encode(text)


def test_tokenizer_padded_to_vocab_size(tmp_path, model):
    from ds4ref.convert.to_gguf import tokenizer_meta
    from ds4ref.gguf.tokenizer import tiny_tokenizer_meta

    cfg, _ = model
    (tmp_path / "tokenizer.json").write_text(json.dumps(_tokenizer_json(tiny_tokenizer_meta(cfg.vocab_size), True)))
    meta = tokenizer_meta(tmp_path, cfg)
    last = cfg.vocab_size - 1
    assert len(meta["tokenizer.ggml.tokens"]) == cfg.vocab_size
    assert meta["tokenizer.ggml.tokens"][last] == f"[PAD{last}]" and meta["tokenizer.ggml.token_type"][last] == 5
