"""Every kernel build the runtime makes compiles for AMD's gfx11 GPUs as HIPRTC compiles it, and
fits the budgets of docs/rocm.md: no scratch, LDS within a workgroup's 64 KiB, enough waves.

The compile is ds4ref.hip.amd_build's: Debian's clang-19 with ROCm's device bitcode and HIPRTC's
own header, the runtime's source, defines and options (hiprtc_options). Without that toolchain
the tests skip naming what is missing; under CI=true that is a failure (.ci/run installs it).
"""
from __future__ import annotations

import os
import re

import pytest

from ds4ref.hip import amd_build
from ds4ref.hip.builds import runtime_builds, tuning_builds

try:
    from pypi_assets import cache_dir
    TOOLCHAIN = amd_build.find_toolchain(amd_build.unpack_header(cache_dir(), cache_dir() / "hiprtc" / "hiprtc_runtime.h"))
except amd_build.MissingToolchain as exc:
    if os.environ.get("CI"):
        pytest.fail(f"{exc}; CI must build the kernels for gfx1151 (.ci/run installs the toolchain)",
                    pytrace=False)
    pytest.skip(str(exc), allow_module_level=True)

# Budgets every kernel a backend launches must keep on gfx11 (docs/rocm.md, "Budgets").
SCRATCH_BYTES = 0           # private memory a thread: scratch is off-chip memory on every access
LDS_BYTES = amd_build.LDS_PER_WORKGROUP
MIN_WAVES_PER_SIMD = 4      # the register file and LDS must leave room for this many waves
# The products whose block dots are int8: each must use gfx11's dot4 with signed operands
INT8_DOT_KERNELS = re.compile(r"^ds4_(qmatvec|qexperts|qgemm)_")
DOT4 = re.compile(r"\bv_dot4_i32_iu8\b")

# The target (Strix Halo) with every tuning variant; the other RDNA 3 chips and RDNA 4's first
# (a different register file and instruction set) with what the runtime builds.
CASES = [("gfx1151", f, o) for f, o in runtime_builds() + tuning_builds("amd")] + \
        [(arch, f, o) for arch in ("gfx1100", "gfx1201") for f, o in runtime_builds()]


@pytest.mark.parametrize("arch,name,options", CASES, ids=[" ".join((a, f, *o)) for a, f, o in CASES])
def test_kernel_builds_within_budget(arch, name, options):
    build = amd_build.compile_file(name, arch, options, TOOLCHAIN)
    assert build.kernels, f"{name}: no kernel in the code object"
    over = [f"{k.name}: {k.scratch} B scratch, {k.vgpr_spill} VGPRs spilled" for k in build.kernels.values()
            if k.scratch > SCRATCH_BYTES or k.vgpr_spill]
    assert not over, f"{arch} {name} {options}: " + "; ".join(over)
    # no kernel sizes LDS at launch (every launch passes shared=0, and no source declares extern
    # __shared__), so a workgroup's LDS is the static size the metadata gives
    big = [f"{k.name}: {k.lds} B" for k in build.kernels.values() if k.lds > LDS_BYTES]
    assert not big, f"{arch} {name}: LDS over {LDS_BYTES} B: {big}"
    few = [f"{k.name}: {k.waves} waves ({k.vgpr} VGPRs, {k.lds} B LDS)" for k in build.kernels.values()
           if k.waves < MIN_WAVES_PER_SIMD]
    assert not few, f"{arch} {name}: fewer than {MIN_WAVES_PER_SIMD} waves a SIMD: {few}"
    if arch.startswith("gfx11"):
        for k in build.kernels:
            if INT8_DOT_KERNELS.match(k):
                assert DOT4.search(amd_build.kernel_isa(build.asm, k)), f"{k}: no v_dot4_i32_iu8 on {arch}"


def test_no_kernel_sizes_lds_at_launch():
    """The budget above reads static LDS alone: that holds while no kernel declares dynamic LDS."""
    from ds4ref.hip.builds import kernel_files
    from ds4ref.hip.runtime import load_source
    dynamic = [f for f in kernel_files() if re.search(r"extern\s+__shared__|HIP_DYNAMIC_SHARED", load_source(f))]
    assert dynamic == []


def test_resources_are_read_from_the_metadata():
    """kernel_resources reads each kernel's own entry: a kernel with a private array indexed at run
    time shows its scratch, the one beside it none, and the names are the kernels'."""
    src = ('extern "C" __global__ void spills(float* y, int i) { float a[64]; '
           'for (int k = 0; k < 64; ++k) a[k] = y[k]; y[0] = a[i & 63]; }\n'
           'extern "C" __global__ void clean(float* y) { y[threadIdx.x] += 1.0f; }\n')
    res = amd_build.compile_source(src, "probe.hip", "gfx1151", (), TOOLCHAIN).kernels
    assert set(res) == {"spills", "clean"}
    assert res["spills"].scratch >= 256 and res["clean"].scratch == 0
    assert res["clean"].waves == 16 and res["clean"].lds == 0
