"""The disk cache of compiled kernels (ds4ref/hip/kernel_cache.py): an entry is reused only for
the same compiler, options and source, writes are whole or absent, and "off" keeps nothing.
The NVRTC case builds a real cubin without a GPU (as tests/test_kernels_compile.py does)."""
from __future__ import annotations

import pytest

from ds4ref.hip import kernel_cache
from ds4ref.hip.runtime import NVRTC_EXACT, load_source


class Builds:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, code: bytes = b"code"):
        def build() -> bytes:
            self.n += 1
            return code + bytes([self.n])
        return build


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4REF_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


def test_an_entry_serves_only_the_same_compiler_options_and_source(folder):
    builds = Builds()
    first = kernel_cache.compiled("nvrtc (13, 5)", ["-DX=1"], "src", builds())
    assert builds.n == 1 and kernel_cache.compiled("nvrtc (13, 5)", ["-DX=1"], "src", builds()) == first
    assert builds.n == 1  # the second process loads the first one's code
    for compiler, options, source in (("nvrtc (13, 6)", ["-DX=1"], "src"), ("nvrtc (13, 5)", ["-DX=2"], "src"),
                                      ("nvrtc (13, 5)", ["-DX=1"], "src2"), ("nvrtc (13, 5)", ["-DX", "=1"], "src")):
        assert kernel_cache.compiled(compiler, options, source, builds()) != first
    assert builds.n == 5
    assert sorted(p.suffix for p in folder.iterdir()) == [".bin"] * 5  # no temporary file left behind


def test_an_empty_or_unwritable_cache_costs_a_build_and_nothing_else(folder, tmp_path, monkeypatch):
    builds = Builds()
    code = kernel_cache.compiled("c", [], "s", builds())
    (folder / kernel_cache.entry_name("c", [], "s")).write_bytes(b"")  # never a valid entry
    assert kernel_cache.compiled("c", [], "s", builds()) != code and builds.n == 2
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("DS4REF_KERNEL_CACHE", str(blocker / "kernels"))  # a folder under a file
    assert kernel_cache.compiled("c", [], "s", builds()) and builds.n == 3


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4REF_KERNEL_CACHE", "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    builds = Builds()
    kernel_cache.compiled("c", [], "s", builds())
    kernel_cache.compiled("c", [], "s", builds())
    assert builds.n == 2 and not any(tmp_path.iterdir())


def test_a_cached_cubin_is_the_cubin_nvrtc_builds(folder):
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
    from ds4ref.hip.runtime import CudaRuntime
    rt = object.__new__(CudaRuntime)  # the build path only, which needs no driver
    rt.nvrtc = nvrtc
    try:
        version = rt._check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except Exception as exc:  # noqa: BLE001 - the library itself may be missing
        pytest.skip(f"NVRTC library not loadable: {exc}")
    source, opts = load_source("norm.hip"), ["--gpu-architecture=sm_90", "-std=c++17", *NVRTC_EXACT]
    cubin = kernel_cache.compiled(f"nvrtc {version}", opts, source, lambda: rt._cubin(source, "norm.hip", opts))
    assert cubin[:4] == b"\x7fELF"
    assert rt._cubin(source, "norm.hip", opts) == cubin
    assert kernel_cache.compiled(f"nvrtc {version}", opts, source, lambda: pytest.fail("built again")) == cubin
