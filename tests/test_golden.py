"""The current reference (or the backend named by DS4REF_BACKEND) against tests/golden.

Regenerate the files with `python -m tests.golden.make_golden` (only when the
model's math is meant to change; say why in the commit).

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
from tests.golden.make_golden import backend_logits, logits_sha256

GOLDEN = Path(__file__).parent / "golden"
BACKEND = os.environ.get("DS4REF_BACKEND", "numpy")

pytestmark = pytest.mark.golden


def load_golden(numerics: str) -> dict:
    return json.loads((GOLDEN / f"tiny_{numerics}.json").read_text())


def load_model(numerics: str, dtype):
    if BACKEND == "hip":
        from ds4ref.hip.runtime import NoGpuError
        try:
            return ds4ref.load(backend="hip", numerics=numerics, dtype=dtype)
        except NoGpuError:
            from skips import NO_GPU
            pytest.skip(NO_GPU)
    return ds4ref.load(numerics=numerics, dtype=dtype)


@pytest.fixture(scope="module", params=["official", "plain"])
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
    g, numerics = golden
    model = ds4ref.load(numerics=numerics, dtype=np.float64)
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
    for numerics in ("official", "plain"):
        g = load_golden(numerics)
        assert g["numerics"] == numerics and g["dtype"] == "float64"
        assert [len(c["prompt"]) for c in g["cases"]] == [1, 7, 64, 203, 600]
        assert all(len(c["float32"]["logits_sha256"]) == 64 for c in g["cases"])
