"""llama.cpp's own conversion of a small checkpoint, read by ds4ref: its converter (the
convert_hf_to_gguf.py that llama-cpp-python 0.3.36 vendors, `DeepseekV4Model`) writes the model
file and, with --mtp, the MTP file; ds4ref loads the pair and its logits and drafts are those of
ds4ref's own conversion of the same checkpoint, bit for bit (docs/mtp.md).

The converter runs from the package's source distribution (tests/pypi_assets.py fetches it) and
needs torch and transformers (the `hf` extra)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ds4ref
from ds4ref.convert.hf import config_to_hf, to_checkpoint_tensors
from ds4ref.gguf.file import MTPFile, stored_values
from ds4ref.gguf.tiny import random_tensors, tiny_config
from ds4ref.gguf.tokenizer import tiny_tokenizer_meta
from pypi_assets import LLAMA_CPP_SDIST, pypi_sdist_folder

CFG = tiny_config(n_layer=4, swiglu_clamp=[2.0] * 4)  # a checkpoint's config has one swiglu_limit
IDS = [0, 5, 77, 300, 12, 9, 401, 33, 250, 18, 64, 100, 7, 222, 91, 3]


# ---- a small checkpoint in the official layout, with its MTP block ------------------------------------------------

def _fp4(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The official FP4 layout (int8-packed E2M1 codes, element 2i in the low nibble; an E8M0
    scale per 32) of gguf-py's MXFP4 quantisation of `arr` (2-D), whose values it keeps."""
    import gguf
    from ds4ref.convert.fp8 import fp4_to_mxfp4
    rows, cols = arr.shape
    mx = gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), gguf.GGMLQuantizationType.MXFP4)
    blocks = mx.reshape(rows, cols // 32, 17)  # a scale byte, then byte j = element j | element j + 16 << 4
    codes = np.concatenate([blocks[..., 1:] & 0xF, blocks[..., 1:] >> 4], axis=-1)
    packed = (codes[..., 0::2] | codes[..., 1::2] << 4).reshape(rows, cols // 2).astype(np.uint8)
    scale = np.ascontiguousarray(blocks[..., 0])
    assert np.array_equal(fp4_to_mxfp4(packed, scale, "check"), mx)
    return packed, scale


def _official_mtp(cfg) -> dict:
    """The MTP block's tensors by the official checkpoint's names (mtp.0.*). e_proj and h_proj hold
    Q8_0 values: llama.cpp's converter always stores eh_proj as Q8_0 (tensor_force_quant), and a
    value of the Q8_0 grid comes back from its quantisation unchanged."""
    from test_convert import official_mtp  # imports torch, which the converter needs anyway
    return official_mtp(cfg, eh=lambda v: stored_values(v, "q8_0"))[0]


def _tokenizer_files(path) -> None:
    """tokenizer.json / tokenizer_config.json of the tiny vocabulary, for transformers' AutoTokenizer."""
    meta = tiny_tokenizer_meta(CFG.vocab_size)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tj = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
          "pre_tokenizer": level, "decoder": level,
          "added_tokens": [{"id": i, "content": t, "special": k == 3, "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False}
                           for i, (t, k) in enumerate(zip(tokens, types)) if k in (3, 4)],
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k not in (3, 4)},
                    "merges": meta["tokenizer.ggml.merges"]}}
    (path / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "bos_token": tokens[0], "eos_token": tokens[1]}))


def mtp_checkpoint(path):
    """config.json, model.safetensors and the tokenizer of CFG with an MTP block, in the official
    layout (official_checkpoint)."""
    config = config_to_hf(CFG, "legacy")
    config.update(num_nextn_predict_layers=1, compress_ratios=[*CFG.compress_ratios, 0])  # as published
    tensors = {**to_checkpoint_tensors(CFG, random_tensors(CFG, 0), names="official"), **_official_mtp(CFG)}
    return official_checkpoint(path, config, tensors)


def official_checkpoint(path, config: dict, tensors: dict):
    """Write `config` (config.json), `tensors` (official names) and the tiny tokenizer to the new
    folder `path` as the official checkpoints hold them: FP4 routed experts (what llama.cpp's
    converter requires of them), F32 the rest."""
    from test_convert_fp8 import write_safetensors
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    out = {}
    for name, arr in tensors.items():
        if ".ffn.experts." in name:
            packed, scale = _fp4(arr)
            out[name] = ("I8", packed.shape, packed.tobytes())
            out[name.removesuffix(".weight") + ".scale"] = ("F8_E8M0", scale.shape, scale.tobytes())
        elif np.issubdtype(arr.dtype, np.integer):
            out[name] = ("I64", arr.shape, arr.astype("<i8").tobytes())
        else:
            out[name] = ("F32", arr.shape, np.asarray(arr, "<f4").tobytes())
    write_safetensors(path / "model.safetensors", out)
    _tokenizer_files(path)
    return path


# ---- llama.cpp's converter ---------------------------------------------------------------------------------

# Runs the vendored converter twice, as its users do: the model file, then --mtp's MTP file. The tiny
# vocabulary's pre-tokeniser hash is not one llama.cpp knows (get_vocab_base_pre refuses unknown
# hashes), so it is named here: DeepSeek-V4's, `joyai-llm`, which ds4ref writes too. The draft's
# flags come after the paths: `--mtp` here, `--dspark --target-model-dir CHECKPOINT` for 0731's.
CONVERT = """
import sys
source, checkpoint, model_out, draft_out, *draft_flags = sys.argv[1:]
sys.path.insert(0, source)
import convert_hf_to_gguf
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "joyai-llm"
for extra, out in (([], model_out), (draft_flags, draft_out)):
    sys.argv = ["convert_hf_to_gguf.py", *extra, "--outfile", out, checkpoint]
    convert_hf_to_gguf.main()
"""


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    pytest.importorskip("torch", reason="llama.cpp's converter needs torch (pip install -e '.[hf]')")
    pytest.importorskip("transformers", reason="llama.cpp's converter needs transformers (pip install -e '.[hf]')")
    from ds4ref.convert.to_gguf import convert
    llama_cpp = pypi_sdist_folder(LLAMA_CPP_SDIST, "vendor/llama.cpp",
                                  ("convert_hf_to_gguf.py", "conversion", "gguf-py"))
    d = tmp_path_factory.mktemp("llama-convert")
    ck = mtp_checkpoint(d / "ck")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp), str(ck), str(d / "llama.gguf"),
                          str(d / "mtp-llama.gguf"), "--mtp"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    convert(ck, d / "ours.gguf", mtp_out=d / "mtp-ours.gguf")
    return d


def test_the_same_tensors_but_eh_proj_s_type(conversions):
    """The MTP files hold the same tensors under the same names, byte for byte, but eh_proj:
    llama.cpp's converter stores it as Q8_0 whatever the source type, ds4ref as --dtype (f32)."""
    theirs, ours = MTPFile(conversions / "mtp-llama.gguf"), MTPFile(conversions / "mtp-ours.gguf")
    assert set(theirs.tensors) == set(ours.tensors)
    eh = f"blk.{CFG.n_layer}.nextn.eh_proj.weight"
    for name, t in theirs.tensors.items():
        if name == eh:
            assert (t.qtype.name, ours.tensor(name).qtype.name) == ("Q8_0", "F32")
            assert theirs.read(name).tobytes() == ours.read(name).tobytes()
        else:
            assert t.qtype == ours.tensor(name).qtype, name
            assert np.asarray(t.data).tobytes() == np.asarray(ours.tensor(name).data).tobytes(), name
    for key in ("deepseek4.block_count", "deepseek4.nextn_predict_layers", "deepseek4.attention.compress_ratios"):
        assert theirs.metadata[key] == ours.metadata[key], key


def test_llama_cpps_files_give_our_logits_and_drafts(conversions):
    """The model file in both numerics; the drafts in plain numerics, where a stored value is read
    as the float it is whatever its storage (official float32 takes a Q8_0 matrix's products in
    integers, an F32 one's in floats: docs/exactness.md §2, so eh_proj's two types differ there)."""
    d = conversions
    for numerics in ("official", "plain"):
        theirs = ds4ref.load(d / "llama.gguf", numerics=numerics, mtp=d / "mtp-llama.gguf")
        ours = ds4ref.load(d / "ours.gguf", numerics=numerics, mtp=d / "mtp-ours.gguf")
        assert theirs.score(IDS).tobytes() == ours.score(IDS).tobytes(), numerics
        if numerics == "plain":
            assert _drafts(theirs).tobytes() == _drafts(ours).tobytes()
        assert f"MTP block from {d / 'mtp-llama.gguf'}" in theirs.describe()


def _drafts(model) -> np.ndarray:
    st = model.reference.new_state()
    _, hidden = model.reference.step_rows([st] * len(IDS), IDS, np.arange(len(IDS)), hidden=True)
    ms = model.mtp.new_state()
    return model.mtp.rows([ms] * (len(IDS) - 1), hidden[:-1], IDS[1:], np.arange(len(IDS) - 1))[0]
