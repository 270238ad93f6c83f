"""The current reference (or the backend named by DS4REF_BACKEND) against tests/golden.

Regenerate the files with `python -m tests.golden.make_golden` (only when the
model's math is meant to change; say why in the commit).
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

import ds4ref

GOLDEN = Path(__file__).parent / "golden"
BACKEND = os.environ.get("DS4REF_BACKEND", "numpy")
# A greedy token may differ on a lower-precision backend only where the float64
# reference's top-2 logits are this close.
NEAR_TIE = 1e-3

pytestmark = pytest.mark.golden


def load_golden(numerics: str) -> dict:
    return json.loads((GOLDEN / f"tiny_{numerics}.json").read_text())


@pytest.fixture(scope="module", params=["official", "plain"])
def golden(request):
    g = load_golden(request.param)
    dtype = np.float64 if BACKEND == "numpy" else np.float32
    try:
        return g, ds4ref.load(backend=BACKEND, numerics=request.param, dtype=dtype)
    except Exception as e:  # DS4REF_BACKEND=hip on a machine without a GPU
        from ds4ref.hip.runtime import NoGpuError
        if isinstance(e, NoGpuError):
            from skips import NO_GPU
            pytest.skip(NO_GPU)
        raise


def test_greedy_continuations(golden):
    g, model = golden
    report = []
    for case in g["cases"]:
        got = model.generate(case["prompt"], len(case["greedy"]))
        for i, (a, b) in enumerate(zip(got, case["greedy"])):
            if a != b:
                gap = case["top2_gap"][i]
                report.append(f"prompt len {len(case['prompt'])}, token {i}: got {a}, golden {b}, "
                              f"reference top-2 gap {gap:.2e}")
                assert BACKEND != "numpy" and gap < NEAR_TIE, "\n".join(report)
                break  # the continuation legitimately forks after a near-tie
    if report:
        print("near-tie forks:\n" + "\n".join(report))


@pytest.mark.skipif(BACKEND != "numpy", reason="fingerprints are float64 reference values")
def test_logit_fingerprints(golden):
    g, model = golden
    for case in g["cases"]:
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
