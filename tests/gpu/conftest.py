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
    except NoGpuError as e:
        # one line per skipped test is enough; `python -c "from ds4ref.hip import get_runtime;
        # get_runtime()"` prints the whole story (what was tried and why each failed)
        pytest.skip("no GPU: " + " | ".join(line.strip() for line in str(e).splitlines()))

