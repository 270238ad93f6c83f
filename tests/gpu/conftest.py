"""GPU op tests: marker `gpu`, skipped with the reason when no GPU runtime opens."""
from __future__ import annotations

import os

import pytest
from hypothesis import Phase, settings

# On the lent GPU time is short: DS4REF_HYPOTHESIS_NO_SHRINK=1 reports a failing example as
# found instead of shrinking it (a shrink replays the NumPy side of a long prompt many times).
if os.environ.get("DS4REF_HYPOTHESIS_NO_SHRINK") == "1":
    settings.register_profile("device", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("device")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def rt():
    from ds4ref.hip.runtime import NoGpuError, get_runtime
    try:
        return get_runtime()
    except NoGpuError:
        # the short reason for every skipped test; the whole story once, in the summary (tests/conftest.py)
        from skips import NO_GPU
        pytest.skip(NO_GPU)

