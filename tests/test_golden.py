"""The current reference (or the backend named by DS4REF_BACKEND) against tests/golden.

Regenerate the files with `python -m tests.golden.make_golden [official plain q2 q4 mxfp4]`
(only when the model's math, or the tiny generator, is meant to change; say why in the commit).
The q2/q4/mxfp4 variants run the files `python -m ds4ref.gguf.tiny --policy P` writes
(generated into a cache, tests.golden.make_golden.policy_model), in official numerics.

float64 cases run on the NumPy reference (plain NumPy maths; the tolerance 1e-9 is for
another machine's BLAS). float32 cases are the canonical arithmetic: every backend,
`DS4REF_BACKEND=hip` included, must give the same greedy tokens and the same logits
bits (sha256) as the generator's NumPy run.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

import ds4ref
from tests.golden.make_golden import POLICIES, backend_logits, file_sha256, logits_sha256, policy_model

GOLDEN = Path(__file__).parent / "golden"
BACKEND = os.environ.get("DS4REF_BACKEND", "numpy")

pytestmark = pytest.mark.golden


VARIANTS = ("official", "plain", *POLICIES)


def golden_file(variant: str) -> Path:
    return GOLDEN / (f"tiny_{variant}_official.json" if variant in POLICIES else f"tiny_{variant}.json")


def load_golden(variant: str) -> dict:
    return json.loads(golden_file(variant).read_text())


def model_path(variant: str):
    """None (the embedded model) or the generated policy file, checked against the golden's sha256."""
    if variant not in POLICIES:
        return None
    path = policy_model(variant)
    assert file_sha256(path) == load_golden(variant)["model_sha256"], (
        f"{path}: the tiny --policy {variant} generator writes another file than the golden's")
    return path


def numerics_of(variant: str) -> str:
    return "official" if variant in POLICIES else variant


def load_model(variant: str, dtype):
    path, numerics = model_path(variant), numerics_of(variant)
    if BACKEND == "hip":
        from ds4ref.hip.runtime import NoGpuError
        try:
            return ds4ref.load(path, backend="hip", numerics=numerics, dtype=dtype)
        except NoGpuError:
            from skips import NO_GPU
            pytest.skip(NO_GPU)
    return ds4ref.load(path, numerics=numerics, dtype=dtype)


@pytest.fixture(scope="module", params=VARIANTS)
def golden(request):
    return load_golden(request.param), request.param


@pytest.fixture(scope="module")
def model32(golden):
    return load_model(golden[1], np.float32)


def test_float32_logits_bits(golden, model32):
    g, _ = golden
    backend = model32.make_backend()
    for case in g["cases"]:
        ids = case["prompt"] + case["float32"]["greedy"][:-1]
        got = logits_sha256(backend_logits(backend, ids))
        assert got == case["float32"]["logits_sha256"], f"prompt length {len(case['prompt'])}: logits bits differ"


def test_float32_greedy_continuations(golden, model32):
    g, _ = golden
    for case in g["cases"]:
        want = case["float32"]["greedy"]
        assert model32.generate(case["prompt"], len(want)) == want, f"prompt length {len(case['prompt'])}"


@pytest.mark.skipif(BACKEND != "numpy", reason="float64 runs on the NumPy reference only")
def test_float64_greedy_and_fingerprints(golden):
    g, variant = golden
    model = ds4ref.load(model_path(variant), numerics=numerics_of(variant), dtype=np.float64)
    for case in g["cases"]:
        assert model.generate(case["prompt"], len(case["greedy"])) == case["greedy"]
        fp = case["fingerprint"]
        logits = model.score(case["prompt"])
        assert logits.argmax(axis=1).tolist() == fp["argmax"]
        np.testing.assert_allclose(logits.max(axis=1), fp["max"], rtol=1e-9, atol=1e-9)
        mx = logits.max(axis=1)
        lse = mx + np.log(np.exp(logits - mx[:, None]).sum(axis=1))
        np.testing.assert_allclose(lse, fp["logsumexp"], rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(logits[-1, fp["last_top_ids"]], fp["last_top_values"], rtol=1e-9, atol=1e-9)


def test_golden_files_record_their_mode():
    from tests.golden.make_golden import POLICY_PROMPT_LENGTHS, PROMPT_LENGTHS
    for variant in VARIANTS:
        g = load_golden(variant)
        assert g["numerics"] == numerics_of(variant) and g["dtype"] == "float64"
        lengths = POLICY_PROMPT_LENGTHS if variant in POLICIES else PROMPT_LENGTHS
        assert [len(c["prompt"]) for c in g["cases"]] == list(lengths)
        assert all(len(c["float32"]["logits_sha256"]) == 64 for c in g["cases"])
        assert g.get("policy") == (variant if variant in POLICIES else None)


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_files_store_the_published_types(policy):
    """q2: IQ2_XXS gate/up + Q2_K down; q4: Q4_K; mxfp4: MXFP4; Q8_0 attention, shared expert,
    output; F16 HC, compressor, indexer, router, embedding (ds4ref.gguf.tiny.POLICIES)."""
    from ds4ref.gguf.file import open_gguf
    from ds4ref.gguf.tiny import POLICIES as TYPES
    f = open_gguf(policy_model(policy))
    gate_up, down = TYPES[policy]
    want = {"blk.3.ffn_gate_exps.weight": gate_up, "blk.3.ffn_up_exps.weight": gate_up,
            "blk.3.ffn_down_exps.weight": down, "blk.2.attn_q_b.weight": "Q8_0",
            "blk.2.ffn_up_shexp.weight": "Q8_0", "output.weight": "Q8_0", "blk.2.hc_attn_fn.weight": "F16",
            "blk.2.attn_compressor_kv.weight": "F16", "blk.2.indexer.proj.weight": "F16",
            "blk.2.ffn_gate_inp.weight": "F16", "token_embd.weight": "F16"}
    assert {n: f.tensor(n).qtype.name for n in want} == want
