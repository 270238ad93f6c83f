"""The ROCm runtime's path through hip-python, checked without a GPU.

hip-python (the `hip` extra) imports on a machine without ROCm and fails only at a call's dlopen,
so its API can be read here: every HIP and HIPRTC call HipRuntime makes is run against a stand-in
that binds the call's arguments to the real binding's signature (a wrong count or name fails as
it would on a Strix Halo) and answers in the bindings' shape, (status, values...). The enums the
runtime names are the bindings' own. Skipped, naming it, when hip-python is not installed.
"""
from __future__ import annotations

import ast
import inspect
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

try:
    from hip import hip as real_hip, hiprtc as real_rtc
except ImportError as exc:
    why = f"hip-python not installed (pip install -e '.[hip]'): {exc}"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must run this test (.ci/run installs it)", pytrace=False)
    pytest.skip(why, allow_module_level=True)

from ds4ref.hip import runtime as runtime_mod  # noqa: E402
from ds4ref.hip.guards import DeviceMemoryError, check_fits_device, memory_advice  # noqa: E402
from ds4ref.hip.runtime import DeviceBuffer, DeviceInfo, HipRuntime, hiprtc_options, load_source  # noqa: E402

RUNTIME_SRC = Path(runtime_mod.__file__)


def hip_calls() -> list[tuple[str, str, int]]:
    """(binding, function, positional argument count or None) of every call in HipRuntime's methods
    on hip (self.hip / hip) or hiprtc (self.rtc / rtc)."""
    tree = ast.parse(RUNTIME_SRC.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HipRuntime")
    out = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner in ("self.hip", "hip", "self.rtc", "rtc"):
                # a starred argument's length is known only when the call runs (the stand-in below binds it)
                n = None if any(isinstance(a, ast.Starred) for a in node.args) else len(node.args)
                out.append(("rtc" if owner.endswith("rtc") else "hip", node.func.attr, n))
    return out


def test_every_call_exists_with_its_argument_count():
    calls = hip_calls()
    assert len({c[1] for c in calls}) >= 25  # the whole surface: device, module, memory, events, graphs
    for binding, fn, nargs in calls:
        mod = real_rtc if binding == "rtc" else real_hip
        assert hasattr(mod, fn), f"hip-python has no {binding}.{fn}"
        params = inspect.signature(getattr(mod, fn)).parameters
        if nargs is not None:
            assert len(params) == nargs, f"{fn} takes {list(params)}, HipRuntime passes {nargs} arguments"


def test_every_enum_the_runtime_names_exists():
    tree = ast.parse(RUNTIME_SRC.read_text())
    chains = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
              and ast.unparse(n).startswith(("self.hip.hip", "self.rtc.hiprtc")) and ast.unparse(n).count(".") == 3}
    assert chains, "the runtime names no enum"
    for chain in chains:
        _, owner, enum, member = chain.split(".")
        mod = real_rtc if owner == "rtc" else real_hip
        assert hasattr(getattr(mod, enum), member), chain


class _Prog:
    def createRef(self):
        return self


class _Binding(types.ModuleType):
    """hip-python's module stand-in: each call binds its arguments to the real signature, is
    logged, and answers (0, values...) from `answers` (default: (0,))."""

    def __init__(self, real, answers, log):
        super().__init__(real.__name__)
        self._real, self._answers, self._log = real, answers, log

    def __getattr__(self, name):
        real = getattr(self._real, name)
        if not callable(real) or isinstance(real, type):
            return real  # enums and structs: the bindings' own

        def call(*args, **kwargs):
            inspect.signature(real).bind(*args, **kwargs)  # TypeError on a wrong argument list
            self._log.append((name, args))
            answer = self._answers.get(name, (0,))
            return answer(*args) if callable(answer) else answer
        return call


def fake_props():
    return types.SimpleNamespace(gcnArchName=b"gfx1151:sramecc-:xnack-", name=b"AMD Radeon 8060S Graphics",
                                 totalGlobalMem=96 << 30, warpSize=32, multiProcessorCount=20,
                                 sharedMemPerBlock=65536, integrated=1)


@pytest.fixture()
def fake_hip(monkeypatch):
    log: list = []
    code = b"\x7fELF fake code object"

    def get_code(prog, buf):
        buf[:] = code
        return (0,)
    hip_answers = {"hipGetDeviceCount": (0, 1), "hipGetDeviceProperties": (0, fake_props()),
                   "hipStreamCreate": (0, "stream"), "hipModuleLoadData": (0, "module"),
                   "hipModuleGetFunction": (0, "function"), "hipMalloc": (0, 0x7000_0000),
                   "hipMemGetInfo": (0, 60 << 30, 96 << 30), "hipEventCreate": (0, "event"),
                   "hipEventElapsedTime": (0, 1.25), "hipStreamEndCapture": (0, "graph"),
                   "hipGraphInstantiateWithFlags": (0, "graph_exec")}
    rtc_answers = {"hiprtcVersion": (0, 7, 2), "hiprtcCreateProgram": (0, _Prog()),
                   "hiprtcGetCodeSize": (0, len(code)), "hiprtcGetCode": get_code}
    pkg = types.ModuleType("hip")
    pkg.hip = _Binding(real_hip, hip_answers, log)
    pkg.hiprtc = _Binding(real_rtc, rtc_answers, log)
    monkeypatch.setitem(sys.modules, "hip", pkg)
    monkeypatch.setenv("DS4REF_KERNEL_CACHE", "off")
    return log


def test_runtime_runs_its_whole_path_against_the_bindings(fake_hip):
    """Open, compile (HIPRTC with the runtime's options for the device's arch), load, allocate,
    copy, launch, time, capture and replay: every call binds to hip-python's signature."""
    rt = HipRuntime()
    assert rt.info == DeviceInfo("amd", "AMD Radeon 8060S Graphics", "gfx1151", 96 << 30, 32, 20, 65536, True)
    mod = rt.compile(load_source("norm.hip"), "norm.hip")
    compiled = [args for name, args in fake_hip if name == "hiprtcCompileProgram"]
    assert [o.decode() for o in compiled[0][2]] == hiprtc_options("gfx1151")
    k = mod.kernel("ds4_rmsnorm")
    x = rt.upload(np.arange(8, dtype=np.float32))
    y = rt.malloc(32)
    rt.memset32(y, 0, 8)
    rt.launch(k, (1,), (256,), (x, None, y, np.int32(8), np.float32(1e-6), None, np.int32(1)))
    out = rt.download(y, (8,), np.float32)
    assert out.shape == (8,)
    start, end = rt.event(), rt.event()
    rt.record(start)
    rt.record(end)
    assert rt.elapsed_ms(start, end) == 1.25
    rt.begin_capture()
    rt.launch(k, (1,), (256,), (x, None, y, np.int32(8), np.float32(1e-6), None, np.int32(1)))
    graph = rt.end_capture()
    rt.replay(graph)
    rt.synchronize()
    assert rt.mem_info() == (60 << 30, 96 << 30)
    rt.free(x)
    called = {name for name, _ in fake_hip}
    used = {fn for _, fn, _ in hip_calls()}
    assert used - called == {"hiprtcGetProgramLogSize", "hiprtcGetProgramLog"}  # a failed compile's log


def test_a_launch_over_the_devices_lds_is_refused(fake_hip):
    rt = HipRuntime()
    k = rt.compile(load_source("norm.hip"), "norm.hip").kernel("ds4_rmsnorm")
    buf = DeviceBuffer(rt, 0x1000, 64)
    with pytest.raises(runtime_mod.GpuError, match="65536 B a block"):
        rt.launch(k, (1,), (256,), (buf, None, buf, np.int32(8), np.float32(1e-6), None, np.int32(1)),
                  shared=65536 + 4)


def test_rocm_is_chosen_without_a_variable(fake_hip, monkeypatch):
    """get_runtime tries HIP first: where hipGetDeviceCount works, ROCm is the runtime."""
    monkeypatch.delenv("DS4REF_GPU_RUNTIME", raising=False)
    runtime_mod.reset_runtime()
    try:
        assert runtime_mod.get_runtime().kind == "hip"
    finally:
        runtime_mod.reset_runtime()


def test_strix_halo_refusal_names_the_carve_out(fake_hip):
    """An APU whose GPU sees too little RAM is told the kernel parameters to change, with the
    page count for what the model needs (4 KiB pages, with the headroom guards.APU_HEADROOM)."""
    rt = HipRuntime()
    need = 81 << 30
    with pytest.raises(DeviceMemoryError) as e:
        check_fits_device(rt, need, "the model's weights")
    pages = (need + (4 << 30)) // 4096
    msg = str(e.value)
    assert f"ttm.pages_limit={pages} ttm.page_pool_size={pages}" in msg
    assert "81.00 GiB" in msg and "60.00 GiB" in msg and "UMA frame buffer" in msg and "85 GiB" in msg
    discrete = DeviceInfo("amd", "Radeon RX 7900 XTX", "gfx1100", 24 << 30, 32, 96)
    assert "ttm" not in memory_advice(discrete, need) and "--max-concurrency" in memory_advice(discrete, need)
