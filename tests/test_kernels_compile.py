"""Every kernel file compiles with NVRTC and the canonical arithmetic's options, without a GPU.

NVRTC is a library: it compiles for sm_90 on a machine with no driver, so CI catches a
kernel that does not build before anyone spends device time (.ci/run installs
cuda-bindings and the NVRTC wheel). Skipped with the reason when NVRTC is missing.
"""
from __future__ import annotations

import pytest

import re

import numpy as np

from ds4ref.hip.builds import runtime_builds, tuning_builds
from ds4ref.hip.runtime import KERNEL_DIR, NVRTC_EXACT, load_source
from ds4ref.hip.signatures import file_signatures

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
try:
    nvrtc.nvrtcVersion()
except Exception as exc:  # noqa: BLE001 - the library itself may be missing
    pytest.skip(f"NVRTC library not loadable: {exc}", allow_module_level=True)

KERNEL_FILES = sorted(p.name for p in KERNEL_DIR.glob("*.hip"))
# every file as a whole, then each build the runtime makes and each tuning variant the GPU twins run
BUILDS = [(f, ()) for f in KERNEL_FILES] + [b for b in runtime_builds() + tuning_builds("nvidia") if b[1]]


def test_every_kernel_file_is_listed():
    assert len(KERNEL_FILES) >= 10


# PTX parameter types of what a launch passes: pointers are 64-bit addresses
PTX_TYPES = {np.int32: ("u32", "s32", "b32"), np.uint32: ("u32", "b32"), np.int64: ("u64", "s64", "b64"),
             np.uint64: ("u64", "b64"), np.float32: ("f32",), np.float64: ("f64",)}


@pytest.mark.parametrize("name,options", BUILDS, ids=[" ".join((f, *o)) for f, o in BUILDS])
def test_kernel_compiles_with_exact_options(name, options):
    """... and the kernels NVRTC built are the ones the launch check parsed from the source (all of
    them for the whole file; a build's macros may leave some out), with the same parameters
    (count, width, integer or float) as the compiled entries."""
    err, prog = nvrtc.nvrtcCreateProgram(load_source(name).encode(), name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        opts = [b"--gpu-architecture=sm_90", b"-std=c++17", *(o.encode() for o in (*NVRTC_EXACT, *options))]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)  # not b" " * size: CPython shares the one-byte b" ", and NVRTC writes into it
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = bytearray(size)
        nvrtc.nvrtcGetPTX(prog, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    entries = {m.group(1): re.findall(r"\.param \.(\w+) ", m.group(2))
               for m in re.finditer(r"\.entry (\w+)\(([^)]*)\)", ptx.decode(errors="replace"))}
    sigs = file_signatures(name)
    if options:
        assert entries and set(entries) <= set(sigs)
    else:
        assert sorted(entries) == sorted(sigs)
    for kernel, types in entries.items():
        want = [("u64", "b64") if p.pointer else PTX_TYPES[p.scalar] for p in sigs[kernel].params]
        assert len(types) == len(want) and all(t in w for t, w in zip(types, want)), (kernel, types, want)


def test_iq2xxs_grid_header_is_gguf_pys():
    """ds4_iq2xxs.h's packed table decodes to gguf-py's IQ2_XXS grid (8, 25, 43 per code)."""
    import re

    import numpy as np
    from gguf import quants
    text = (KERNEL_DIR / "ds4_iq2xxs.h").read_text()
    words = [int(v, 16) for v in re.findall(r"0x([0-9a-f]{4})", text.split("{", 1)[1])]
    assert len(words) == 256
    codes = np.array([[(w >> (2 * e)) & 3 for e in range(8)] for w in words])
    quants.IQ2_XXS.init_grid()
    assert np.array_equal(np.array([8.0, 25.0, 43.0])[codes], quants.IQ2_XXS.grid.reshape(256, 8))


def test_compile_logs_leave_python_bytes_alone():
    """Regression: a log buffer made as b" " * 1 is CPython's shared b" "; NVRTC wrote its NUL
    into it and every b" " in the process became b"\\x00" (the tokenizer's streaming broke)."""
    from ds4ref.hip.runtime import CudaRuntime
    rt = object.__new__(CudaRuntime)  # only the compile-log path, which needs no driver
    rt.nvrtc = nvrtc
    prog = nvrtc.nvrtcCreateProgram(load_source("norm.hip").encode(), b"norm.hip", 0, [], [])[1]
    try:
        opts = [b"--gpu-architecture=sm_90"]
        assert nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
        assert rt._log(prog).strip("\x00 ") == ""
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    assert b" "[0] == 32 and " ".encode()[0] == 32  # by value: every one-byte b" " is the same object
