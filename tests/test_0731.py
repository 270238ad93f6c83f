"""DeepSeek-V4-Flash-0731 as a model ds4ref loads: the version a file says it is (gguf.version),
the tiny 0731 model and its DSpark draft (gguf.tiny), ds4ref's converter on a 0731 checkpoint
(--dspark-out: llama.cpp's dflash file), and drafts refused beside a model they do not belong to
(gguf.draft_target), MTP files included."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ds4ref
from ds4ref.gguf.dspark import DFLASH_ARCH, DSparkError, dflash_name, dspark_tensor_shapes, name_table
from ds4ref.gguf.draft_target import TARGET_FINGERPRINT, DraftTargetError, check_draft_target
from ds4ref.gguf.file import MTPFile, open_gguf
from ds4ref.gguf.mtp import MTPError
from ds4ref.gguf.tiny import (default_model_path, default_mtp_path, main as tiny_main, random_dspark, tiny_0731_config, tiny_config,
                              tiny_dspark, write_tiny)
from ds4ref.gguf.version import DSPARK_STAGES, ORIGINAL, V0731, model_version

IDS = [0, 5, 77, 300, 12, 9, 401, 33, 250, 18]


@pytest.fixture(scope="module")
def files(tiny_0731):
    """The folder of the tiny 0731 model and its draft (conftest: m.gguf, draft.gguf), with a
    model of another seed and its draft, a 0731 model too shallow for the draft, and an MTP file
    of a model of other sizes."""
    d = tiny_0731[0].parent
    tiny_main(["--version", "0731", "--seed", "1", "--out", str(d / "m1.gguf"), "--dspark-out", str(d / "draft1.gguf")])
    write_tiny(d / "shallow.gguf", tiny_0731_config(n_layer=2, n_hash_layers=1))
    write_tiny(d / "wide.gguf", tiny_config(n_head=8), mtp=d / "mtp-wide.gguf")
    return d


# ---- the version ------------------------------------------------------------------------------------------

def test_packaged_tiny_is_the_original_and_the_0731_tiny_says_0731(files):
    assert open_gguf(default_model_path()).config.version == ORIGINAL
    cfg = open_gguf(files / "m.gguf").config
    assert (cfg.version, cfg.name, cfg.n_layer) == (V0731, "ds4-tiny-0731", 6)
    meta = open_gguf(files / "m.gguf").metadata
    assert meta["deepseek4.attention.compress_ratios"] == [*cfg.compress_ratios, 0, 0, 0]


def test_the_version_is_metadata_only(files):
    """The 0731 tiny is the original tiny's weights under another name and version: the same logits."""
    assert ds4ref.load(files / "m.gguf").score(IDS).tobytes() == ds4ref.load().score(IDS).tobytes()


BASE = {"general.architecture": "deepseek4", "general.name": "DeepSeek V4 Flash", "deepseek4.block_count": 43,
        "deepseek4.attention.compress_ratios": [0] * 44}


@settings(max_examples=60, deadline=None)
@given(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.sampled_from([0, 1]))
def test_any_sign_makes_a_file_0731(ratios, name, key, template, nextn):
    """compress_ratios with the stages' entries, '0731' in general.name, deepseek4.dspark.* keys, 0731's
    chat template: each alone says 0731; none says the original (an MTP file's block counted)."""
    meta = dict(BASE, **{"deepseek4.nextn_predict_layers": nextn} if nextn else {})
    meta["deepseek4.block_count"] = 43 + nextn
    meta["deepseek4.attention.compress_ratios"] = [0] * (43 + (DSPARK_STAGES if ratios else 1))
    if name:
        meta["general.name"] = "DeepSeek V4 Flash 0731"
    if key:
        meta["deepseek4.dspark.block_size"] = 5
    meta["tokenizer.chat_template"] = ("Reasoning Effort: Beyond maximum" if template
                                       else "Reasoning Effort: Absolute maximum")
    assert model_version(meta) == (V0731 if ratios or name or key or template else ORIGINAL)
    assert model_version(dict(meta, **{"general.name": "DeepSeek V4 Flash 20731"})) == model_version(
        {k: v for k, v in meta.items() if k != "general.name"})  # '0731' as a word only


# ---- the draft file ---------------------------------------------------------------------------------------

def test_the_tiny_draft_is_llama_cpps_dflash_layout(files):
    cfg = open_gguf(files / "m.gguf").config
    dcfg = tiny_dspark(cfg)
    draft = MTPFile(files / "draft.gguf")
    meta = draft.metadata
    assert meta["general.architecture"] == DFLASH_ARCH
    assert (meta["dflash.block_count"], meta["dflash.block_size"], meta["tokenizer.ggml.mask_token_id"]) == (3, 5, 511)
    assert meta["dflash.target_layers"] == [4, 5, 6]  # llama.cpp's converter stores layer id + 1
    assert meta["dflash.attention.compress_ratios"] == [0, 0, 0] and meta["dflash.hash_layer_count"] == 0
    table = name_table(cfg, dcfg)
    assert {n: tuple(t.shape) for n, t in draft.tensors.items()} == {theirs: shape for _, theirs, shape in table}
    assert len({ours for ours, _, _ in table}) == len(table) == len(draft.tensors)
    values, _ = random_dspark(cfg, dcfg, 0)
    for ours in ("mtp.0.main_norm.weight", "mtp.2.markov_head.markov_w1.weight", "mtp.1.attn_sinks.weight"):
        assert np.array_equal(draft.read(dflash_name(ours, dcfg)), values[ours].astype(np.float16).astype(np.float32)
                              if values[ours].ndim == 2 else values[ours])
    assert {dflash_name(f"mtp.{s}.{x}", dcfg) for s, x in ((0, "main_proj.weight"), (0, "main_norm.weight"),
                                                            (2, "norm.weight"), (2, "confidence_head.proj.weight"),
                                                            (1, "attn_q_a.weight"))} == {
        "fc.weight", "enc.output_norm.weight", "output_norm.weight", "conf_proj.weight", "blk.1.attn_q_a.weight"}


def test_the_right_pair_passes(files):
    model = open_gguf(files / "m.gguf")
    draft = MTPFile(files / "draft.gguf")
    check_draft_target(draft.metadata, draft.path, model, draft)
    ds4ref.load(default_model_path(), mtp=default_mtp_path())  # the original and its MTP file


def refusal(draft_path, model_path) -> str:
    draft = MTPFile(draft_path)
    with pytest.raises(DraftTargetError) as err:
        check_draft_target(draft.metadata, draft.path, open_gguf(model_path), draft)
    msg = str(err.value)
    assert str(draft_path) in msg and str(model_path) in msg
    return msg


def test_drafts_beside_another_model_are_refused_by_name(files):
    assert "the model is the original release" in refusal(files / "draft.gguf", default_model_path())
    assert f"{TARGET_FINGERPRINT} =" in refusal(files / "draft.gguf", files / "m1.gguf")
    assert "after target layers [3, 4, 5], the model has 2 layers" in refusal(files / "draft.gguf",
                                                                             files / "shallow.gguf")
    with pytest.raises(DSparkError, match=f"{files / 'draft.gguf'} belongs to another model than "
                                          f"{files / 'm1.gguf'}: .*{TARGET_FINGERPRINT}"):
        ds4ref.load(files / "m1.gguf", dspark=files / "draft.gguf")  # the reader checks it


def test_an_original_mtp_file_beside_0731_is_refused(files):
    msg = refusal(default_mtp_path(), files / "m.gguf")
    assert "has no NextN MTP head" in msg
    with pytest.raises(MTPError, match="has no NextN MTP head"):
        ds4ref.load(files / "m.gguf", mtp=default_mtp_path())


def test_mtp_files_of_another_model_are_refused(files):
    assert "deepseek4.attention.head_count is 8, the model's deepseek4.attention.head_count is 4" in refusal(
        files / "mtp-wide.gguf", default_model_path())
    write_tiny(files / "seed2.gguf", seed=2, mtp=files / "mtp-seed2.gguf")  # same sizes, other weights
    assert "copy of the model's 'output_norm.weight' holds other values" in refusal(files / "mtp-seed2.gguf",
                                                                                     default_model_path())
    with pytest.raises(MTPError, match="belongs to another model"):
        ds4ref.load(default_model_path(), mtp=files / "mtp-seed2.gguf")
    with pytest.raises(MTPError, match="DSpark draft .* not an MTP file"):
        ds4ref.load(files / "m.gguf", mtp=files / "draft.gguf")
    with pytest.raises(ValueError, match="is a DSpark draft .* not a model"):
        ds4ref.load(files / "draft.gguf")


# ---- ds4ref's converter on a 0731 checkpoint --------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from checkpoint_0731 import checkpoint_0731
    from ds4ref.convert.to_gguf import convert
    d = tmp_path_factory.mktemp("convert-0731")
    ck, draft = checkpoint_0731(d / "DeepSeek-V4-Flash-0731-tiny")
    convert(ck, d / "alone.gguf")
    convert(ck, d / "m.gguf", dspark_out=d / "draft.gguf")
    return d, ck, draft


def test_converter_writes_0731_and_its_draft_beside(converted):
    d, ck, values = converted
    assert (d / "alone.gguf").read_bytes() == (d / "m.gguf").read_bytes()  # the draft never changes the model
    model = open_gguf(d / "m.gguf")
    assert model.config.version == V0731 and model.metadata["deepseek4.attention.compress_ratios"] == [0, 0, 4, 128,
                                                                                                       0, 0, 0]
    draft = MTPFile(d / "draft.gguf")
    check_draft_target(draft.metadata, draft.path, model, draft)
    assert draft.metadata[TARGET_FINGERPRINT]
    from checkpoint_0731 import DSPARK
    for ours, shape in dspark_tensor_shapes(model.config, DSPARK).items():
        if "exps" not in ours:  # experts went through FP4 (tests/test_llama_cpp_convert_0731.py compares them)
            assert np.array_equal(draft.read(dflash_name(ours, DSPARK)), values[ours]), ours


def test_converter_refuses_mtp_out_for_a_dspark_checkpoint(converted, tmp_path):
    from ds4ref.convert.to_gguf import ConvertError, convert
    d, ck, _ = converted
    with pytest.raises(ConvertError, match="DSpark draft .*--dspark-out"):
        convert(ck, tmp_path / "x.gguf", mtp_out=tmp_path / "mtp.gguf")


# ---- the server's reasoning_effort per version ------------------------------------------------------------

def test_the_server_maps_reasoning_effort_per_version(files):
    """A chat request's reasoning_effort (which also turns thinking on) puts the instruction of
    the served model's version first: `high` is nothing for the original and the original's `max`
    text for 0731; `max` is the original's text, or 0731's new one."""
    import httpx
    from ds4ref.serve.chat import EFFORT_PROMPTS, render_chat
    from serve_helpers import LiveServer
    chat = [{"role": "user", "content": "prove it"}]
    seen = {}
    for path, version in ((default_model_path(), ORIGINAL), (files / "m.gguf", V0731)):
        with LiveServer(model_path=str(path), max_concurrency=1, max_context=1024) as s:
            assert s.state.chat_version == version
            for effort in ("low", "high", "max"):
                ids = httpx.post(s.url + "/tokenize", json={"messages": chat, "reasoning_effort": effort},
                                 timeout=60).json()["tokens"]
                text = s.state.tokenizer.decode(ids)
                assert text == render_chat(chat, True, reasoning_effort=effort, version=version)
                seen[version, effort] = text
    plain = render_chat(chat, True)
    assert seen[ORIGINAL, "low"] == seen[ORIGINAL, "high"] == seen[V0731, "low"] == plain
    assert seen[ORIGINAL, "max"] == seen[V0731, "high"] == plain[:len("<｜begin▁of▁sentence｜>")] + \
        EFFORT_PROMPTS[ORIGINAL]["max"] + plain[len("<｜begin▁of▁sentence｜>"):]
    assert "Beyond maximum" in seen[V0731, "max"] and seen[V0731, "max"] != seen[ORIGINAL, "max"]
