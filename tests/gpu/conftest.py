"""GPU op tests: marker `gpu`, skipped with the reason when no GPU runtime opens."""
from __future__ import annotations

import pytest


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

