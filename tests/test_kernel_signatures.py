"""Kernel parameter lists read from the sources, and the launch check built on them (no GPU).

Every extern "C" kernel of every kernel file parses (test_kernels_compile.py checks the
parsed lists against NVRTC's own, parameter by parameter); a launch with a wrong argument
count or scalar type is refused naming the kernel; the backend's recorded passes are checked
in test_hip_program.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ds4ref.hip.runtime import KERNEL_DIR, DeviceBuffer, Kernel, launch_handle, load_source, pack_args
from ds4ref.hip.signatures import (KernelArgumentError, KernelSignatureError, file_signatures,
                                   parse_signatures)

KERNEL_FILES = sorted(p.name for p in KERNEL_DIR.glob("*.hip"))


def buf(n: int = 64) -> DeviceBuffer:
    return DeviceBuffer(None, 0, n)


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_every_kernel_parses(name):
    """Each kernel the file defines, written out or made by a macro (`MACRO(name, ...)` on a
    line of its own), is parsed, with a type a launch can pass for every parameter."""
    sigs = file_signatures(name)
    text = load_source(name).replace("\\\n", " ")
    written = re.findall(r'^extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(', text, re.M)
    made = re.findall(r"^[A-Z][A-Z0-9_]*\((\w+),", text, re.M)
    assert sigs and set(written) | set(made) <= set(sigs), sorted(set(written) | set(made) - set(sigs))
    for sig in sigs.values():
        assert all(p.pointer or p.scalar is not None for p in sig.params)


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_every_kernel_waits_for_the_one_before_it_first(name):
    """runtime.py launches every kernel with programmatic dependent launch on sm_90+, so a kernel
    may start while the one before it in the stream runs: each body must open with
    DS4_KERNEL_ENTRY (its griddepcontrol.wait) before it reads or writes anything."""
    text = load_source(name).replace("\\\n", " ")
    bodies = [text[m.end():] for m in re.finditer(r'extern "C" __global__[^{]*\{', text)]
    first = ("DS4_KERNEL_ENTRY;", "DS4_KERNEL_ENTRY_PREFETCH(")  # the latter: a weight prefetch, then the wait
    assert bodies and all(b.lstrip().startswith(first) for b in bodies), \
        [b.lstrip()[:60] for b in bodies if not b.lstrip().startswith(first)]
    assert "griddepcontrol.wait" in load_source(name)  # the header's definition is inlined


def test_parses_the_forms_the_kernels_use():
    src = r'''
    typedef unsigned long long my_u64;
    #define REAL float
    #define MAKE(NAME, T)                                   \
        extern "C" __global__ void __launch_bounds__(8 * (4)) \
            NAME(const T* __restrict__ x, T y, int n) { }     \
        extern "C" __global__ void NAME##_ks(T* x) { }
    MAKE(k_f, float)
    MAKE(k_d, double)
    /* extern "C" __global__ void commented_out(int a) {} */
    extern "C" __global__ void plain(const REAL* a, REAL b, long long c, unsigned d, my_u64 e,
                                     float v[], int64_t f) {}
    '''
    sigs = parse_signatures(src, "t.hip")
    assert sorted(sigs) == ["k_d", "k_d_ks", "k_f", "k_f_ks", "plain"]
    assert [p.scalar for p in sigs["k_d"].params] == [None, np.float64, np.int32]
    assert [(p.name, p.pointer, p.scalar) for p in sigs["plain"].params] == [
        ("a", True, None), ("b", False, np.float32), ("c", False, np.int64), ("d", False, np.uint32),
        ("e", False, np.uint64), ("v", True, None), ("f", False, np.int64)]
    with pytest.raises(KernelSignatureError, match="bad.*short"):
        parse_signatures('extern "C" __global__ void bad(short s) {}', "t.hip")
    with pytest.raises(KernelSignatureError, match="default"):
        parse_signatures('extern "C" __global__ void dflt(int s = 3) {}', "t.hip")


def test_wrong_count_and_wrong_scalar_type_are_refused_by_name():
    sig = file_signatures("step_ops.hip")["step_expert_list"]
    k = Kernel("handle", sig.kernel, sig)
    good = (buf(), buf(), np.int32(16), np.int32(6), np.int32(256), buf())
    assert launch_handle(k, good) == "handle"
    with pytest.raises(KernelArgumentError, match=r"step_expert_list.*5 arguments, the kernel takes 6"):
        launch_handle(k, good[:2] + good[3:])  # the drift benchmarks/ops_gpu.py had: no L
    hc = file_signatures("hc.hip")["ds4_hc_pre_finish"]
    args = [buf(), buf(), buf(), buf(), np.int32(4), np.int32(64), np.float32(1e-6), np.float32(1e-6),
            np.int32(20), np.int32(512), buf(), buf(), buf(), None, None, np.int32(0), np.int32(0)]
    hc.check(args)
    args[7] = np.float64(1e-6)  # a float64 to a float: pack_args would pass 8 bytes where 4 are read
    with pytest.raises(KernelArgumentError, match=r"ds4_hc_pre_finish.*argument 7 \(float hc_eps\) is "
                                                  r"np.float64, the parameter takes np.float32"):
        hc.check(args)
    args[7] = np.float32(1e-6)
    for bad, what in ((np.int32(0), "np.int32"), (3, "int")):
        args[0] = bad  # a scalar where a pointer goes
        with pytest.raises(KernelArgumentError, match=rf"argument 0 \(float\* streams\) is {what}, "
                                                      r"the parameter takes a DeviceBuffer or None"):
            hc.check(args)
    args[0], args[4] = None, 4  # a null pointer is fine; a Python int is never
    with pytest.raises(KernelArgumentError, match=r"argument 4 \(int hc\) is int"):
        hc.check(args)


def test_the_accepted_scalars_are_what_pack_args_packs():
    """Every scalar type the parser maps to is one pack_args accepts, at the C type's width."""
    from ds4ref.hip.signatures import SCALAR_TYPES
    widths = {"int": 4, "unsigned": 4, "long long": 8, "unsigned long long": 8, "float": 4, "double": 8}
    for ctype, t in SCALAR_TYPES.items():
        _ptrs, holders = pack_args([t(1)])
        base = next((w for w in sorted(widths, key=len, reverse=True) if ctype.replace(" int", "").endswith(w)), None)
        if base:
            assert holders[0].nbytes == widths[base], ctype
