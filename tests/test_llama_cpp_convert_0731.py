"""llama.cpp's own conversion of a small DeepSeek-V4-Flash-0731 checkpoint (tests/checkpoint_0731.py),
read by ds4ref: its converter (the convert_hf_to_gguf.py that llama-cpp-python 0.3.36 vendors)
writes the model file, and with --dspark the DSpark draft as a `dflash` GGUF
(`DeepseekV4DSparkModel`). ds4ref's converter writes the same tensors, byte for byte, in both files;
ds4ref reads llama.cpp's model file as 0731 and runs it as its own conversion, bit for bit.

The converter runs from the package's source distribution (tests/pypi_assets.py fetches it, with
the chat templates it embeds) and needs torch and transformers (the `hf` extra)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ds4ref
from ds4ref.gguf.draft_target import check_draft_target
from ds4ref.gguf.file import MTPFile, open_gguf
from ds4ref.gguf.version import V0731, chat_version, version_signs
from pypi_assets import LLAMA_CPP_SDIST, pypi_sdist_file, pypi_sdist_folder
from test_llama_cpp_convert import CONVERT  # the vendored converter run twice: the model, then the draft

IDS = [0, 5, 77, 300, 12, 9, 401, 33, 250, 18, 64, 100, 7, 222, 91, 3]
TEMPLATE = "deepseek-ai-DeepSeek-V4-Flash-0731.jinja"
# keys llama.cpp's converter adds that ds4ref reads nothing from (its naming heuristics, the
# quantisation version, the graph's HC width) and the ones whose values differ by design
# (general.name from the folder, file_type 38 = MXFP4 experts vs ds4ref's --dtype code)
THEIRS_ONLY = {"general.basename", "general.quantization_version", "general.size_label", "general.type",
               "general.version", "deepseek4.embedding_length_out", "deepseek4.swiglu_clamp_shexp"}
DIFFER = {"general.name", "general.file_type"}

@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    pytest.importorskip("torch", reason="llama.cpp's converter needs torch (pip install -e '.[hf]')")
    pytest.importorskip("transformers", reason="llama.cpp's converter needs transformers (pip install -e '.[hf]')")
    from checkpoint_0731 import checkpoint_0731
    from ds4ref.convert.to_gguf import convert
    source = pypi_sdist_folder(LLAMA_CPP_SDIST, "vendor/llama.cpp", ("convert_hf_to_gguf.py", "conversion", "gguf-py"))
    d = tmp_path_factory.mktemp("llama-convert-0731")
    # a copy beside the template it embeds for a checkpoint whose folder's name says 0731
    # (conversion/deepseek.py reads ../models/templates)
    llama_cpp = d / "llama.cpp"
    for part in ("conversion", "gguf-py"):
        shutil.copytree(source / part, llama_cpp / part)
    shutil.copy(source / "convert_hf_to_gguf.py", llama_cpp)
    (llama_cpp / "models" / "templates").mkdir(parents=True)
    template = pypi_sdist_file(LLAMA_CPP_SDIST, f"vendor/llama.cpp/models/templates/{TEMPLATE}")
    shutil.copy(template, llama_cpp / "models" / "templates")
    ck, _ = checkpoint_0731(d / "DeepSeek-V4-Flash-0731-tiny")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp), str(ck), str(d / "llama.gguf"),
                          str(d / "dflash-llama.gguf"), "--dspark", "--target-model-dir", str(ck)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    convert(ck, d / "ours.gguf", dspark_out=d / "dflash-ours.gguf")
    return d, template.read_text(encoding="utf-8")


def _same_tensors(a: MTPFile, b: MTPFile) -> None:
    assert list(sorted(a.tensors)) == list(sorted(b.tensors))
    for name, t in a.tensors.items():
        u = b.tensor(name)
        assert (t.qtype, tuple(t.shape)) == (u.qtype, tuple(u.shape)), name
        assert np.asarray(t.data).tobytes() == np.asarray(u.data).tobytes(), name


def _same_metadata(theirs: dict, ours: dict) -> None:
    """The model's keys agree (the vocabulary's tables aside: transformers' reading of the tiny
    tokenizer types its tokens otherwise; tests/test_llama_cpp_convert.py has the same)."""
    vocab = {k for k in theirs if k.startswith("tokenizer.") and not k.endswith("_token_id")}
    only_theirs = set(theirs) - set(ours) - vocab
    assert only_theirs <= THEIRS_ONLY | {k.replace("deepseek4.", "dflash.") for k in THEIRS_ONLY}, only_theirs
    for key in set(theirs) & set(ours) - DIFFER - vocab:
        assert theirs[key] == ours[key], key


def test_the_model_file_is_0731_and_runs_as_ours(conversions):
    d, template = conversions
    theirs, ours = open_gguf(d / "llama.gguf"), open_gguf(d / "ours.gguf")
    assert theirs.config.version == ours.config.version == V0731
    assert len(version_signs(theirs.metadata)) == 3  # its compress_ratios, its name, its template
    assert theirs.metadata["tokenizer.chat_template"] == template and chat_version(theirs.metadata) == V0731
    assert theirs.metadata["deepseek4.attention.compress_ratios"] == [0, 0, 4, 128, 0, 0, 0]
    _same_tensors(MTPFile(d / "llama.gguf"), MTPFile(d / "ours.gguf"))
    _same_metadata(theirs.metadata, ours.metadata)
    for numerics in ("official", "plain"):
        a, b = (ds4ref.load(d / f, numerics=numerics) for f in ("llama.gguf", "ours.gguf"))
        assert a.score(IDS).tobytes() == b.score(IDS).tobytes()


def test_the_dflash_draft_is_ours_byte_for_byte(conversions):
    d, _ = conversions
    theirs, ours = MTPFile(d / "dflash-llama.gguf"), MTPFile(d / "dflash-ours.gguf")
    _same_tensors(theirs, ours)
    _same_metadata(theirs.metadata, ours.metadata)
    assert theirs.metadata["dflash.target_layers"] == [2, 3, 4]  # layers 1, 2, 3 of 4, stored + 1
    for draft in (theirs, ours):  # each draft belongs to either model file: they hold the same model
        for model in ("llama.gguf", "ours.gguf"):
            check_draft_target(draft.metadata, draft.path, open_gguf(d / model), draft)
