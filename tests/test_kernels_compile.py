"""Every kernel file compiles with NVRTC and the canonical arithmetic's options, without a GPU.

NVRTC is a library: it compiles for sm_90 on a machine with no driver, so CI catches a
kernel that does not build before anyone spends device time (.ci/run installs
cuda-bindings and the NVRTC wheel). Skipped with the reason when NVRTC is missing.
"""
from __future__ import annotations

import pytest

from ds4ref.hip.runtime import KERNEL_DIR, NVRTC_EXACT, load_source

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
try:
    nvrtc.nvrtcVersion()
except Exception as exc:  # noqa: BLE001 - the library itself may be missing
    pytest.skip(f"NVRTC library not loadable: {exc}", allow_module_level=True)

KERNEL_FILES = sorted(p.name for p in KERNEL_DIR.glob("*.hip"))


def test_every_kernel_file_is_listed():
    assert len(KERNEL_FILES) >= 11


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_compiles_with_exact_options(name):
    err, prog = nvrtc.nvrtcCreateProgram(load_source(name).encode(), name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        opts = [b"--gpu-architecture=sm_90", b"-std=c++17", *(o.encode() for o in NVRTC_EXACT)]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
