"""One small GPU runtime interface with two adapters.

    rt = get_runtime()                      # HIP (ROCm) first, then CUDA; or DS4REF_GPU_RUNTIME
    mod = rt.compile(load_source("norm.hip"), "norm.hip")
    k = mod.kernel("ds4_rmsnorm")
    buf = rt.malloc(n); rt.h2d(buf, array); rt.launch(k, grid, block, (buf, np.int32(3)), shared=0)
    rt.d2h(array, buf); rt.synchronize()

Kernels are written once in the HIP dialect (kernels/*.hip with the portability
header kernels/ds4_hip.h) and compiled by HIPRTC for the device's gcnArchName, or
by NVRTC for sm_XX. Every driver call's status is checked and turned into a
GpuError naming the call. Importing this module needs no GPU library: they are
imported when a runtime is constructed, and get_runtime() raises NoGpuError
saying which runtimes were tried and why each failed.

Kernel arguments are explicit: a DeviceBuffer (passed as its pointer), None (a
null pointer) or a NumPy scalar of the kernel parameter's exact type
(np.int32, np.int64, np.float32, np.float64, np.uint64). Plain Python numbers are
refused, because their width is ambiguous and a wrong width corrupts the launch.
Each launch is checked against the kernel's parameter list, read from its source
when the file is compiled (signatures.py): a wrong count or type raises
KernelArgumentError naming the kernel and the parameter.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..settings import getenv
from . import kernel_cache
from .buffers import KERNEL_DIR, DeviceBuffer, load_source  # noqa: F401 - the runtime's surface
from .signatures import Signature, check_launch, parse_signatures

HEADER = "ds4_hip.h"
ENV_RUNTIME = "DS4REF_GPU_RUNTIME"


class NoGpuError(RuntimeError):
    """No usable GPU runtime: the message lists each runtime tried and why it failed."""


class GpuError(RuntimeError):
    """A GPU runtime call failed; the message names the call and the status."""


@dataclass(frozen=True)
class DeviceInfo:
    vendor: str          # "amd" or "nvidia"
    name: str
    arch: str            # "gfx1151", "sm_90", ...
    total_bytes: int
    warp_size: int
    multiprocessors: int
    shared_per_block: int = 48 << 10  # LDS / shared memory a block may use, static and dynamic
    integrated: bool = False          # an APU's GPU: its memory is a carve-out of system RAM


# The canonical arithmetic (docs/exactness.md) on each compiler: no multiply-add
# contraction, IEEE division and square root, subnormals kept. NVRTC's own defaults
# already give the last three; they are spelled out so no option file can flip them.
NVRTC_EXACT = ("--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false")
HIPRTC_EXACT = ("-ffp-contract=off", "-fno-fast-math", "-fhip-fp32-correctly-rounded-divide-sqrt",
                "-fno-gpu-flush-denormals-to-zero")


def hiprtc_options(arch: str, options: Sequence[str] = ()) -> list[str]:
    """HIPRTC's option list for a kernel file (the offline AMD build, amd_build.py, passes the same)."""
    return [f"--offload-arch={arch}", "-O3", "-std=c++17", *HIPRTC_EXACT, *options]


_ARG_TYPES = (np.int32, np.int64, np.uint32, np.uint64, np.float32, np.float64)


def pack_args(args: Sequence[Any]) -> tuple[np.ndarray, list[np.ndarray]]:
    """kernelParams: an array of pointers to each argument's value (kept alive by the caller)."""
    holders: list[np.ndarray] = []
    for i, a in enumerate(args):
        if isinstance(a, DeviceBuffer):
            holders.append(np.array([a.ptr], dtype=np.uint64))
        elif a is None:
            holders.append(np.array([0], dtype=np.uint64))
        elif isinstance(a, _ARG_TYPES):
            holders.append(np.array([a], dtype=type(a)))
        else:
            raise TypeError(f"kernel argument {i} is {type(a).__name__}; pass a DeviceBuffer, None "
                            f"or a NumPy scalar of the parameter's exact type (np.int32, np.float32, ...)")
    ptrs = np.array([h.ctypes.data for h in holders], dtype=np.uint64)
    return ptrs, holders


def _status(err: Any) -> int:
    return int(getattr(err, "value", err))


@dataclass(frozen=True, eq=False)
class Kernel:
    """A loaded kernel and its parameter list; launches are checked against it."""
    handle: Any
    name: str
    signature: Signature


class Module:
    def __init__(self, rt: "Runtime", handle: Any, name: str, source: str):
        self.rt, self.handle, self.name = rt, handle, name
        self.signatures = parse_signatures(source, name)  # parsed at compile: a bad list fails at load
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, fn: str) -> Kernel:
        if fn not in self._kernels:
            if fn not in self.signatures:
                raise GpuError(f"{self.name}: no extern \"C\" __global__ kernel {fn} in the source")
            self._kernels[fn] = Kernel(self.rt._get_function(self, fn), fn, self.signatures[fn])
        return self._kernels[fn]


def launch_handle(kernel: Any, args: Sequence[Any], shared: int = 0, info: DeviceInfo | None = None) -> Any:
    """The driver's handle of kernel, after checking args against its parameters and the
    launch's dynamic shared memory against the device's limit (info.shared_per_block)."""
    check_launch(kernel, args)
    if shared and info is not None and shared > info.shared_per_block:
        name = getattr(kernel, "name", kernel)
        raise GpuError(f"{name}: {shared} B of dynamic shared memory, over {info.name}'s "
                       f"{info.shared_per_block} B a block")
    return kernel.handle if isinstance(kernel, Kernel) else kernel


class Runtime(ABC):
    """The interface both adapters implement."""

    kind = "base"
    info: DeviceInfo

    # ---- status checking -----------------------------------------------------
    def _check(self, result: Any, call: str) -> Any:
        """result is the binding's tuple (status, values...): raise on a bad status, return the values."""
        if isinstance(result, tuple):
            err, vals = result[0], result[1:]
        else:
            err, vals = result, ()
        if _status(err) != 0:
            raise GpuError(f"{self.kind}: {call} failed with {self._error_name(err)}")
        if not vals:
            return None
        return vals[0] if len(vals) == 1 else vals

    def _error_name(self, err: Any) -> str:
        return repr(err)

    # ---- threads ---------------------------------------------------------------
    def bind_thread(self) -> None:
        """Make this runtime's device current on the calling thread (once per thread).

        CUDA contexts and HIP's current device are per thread: the server steps the
        backend from its runner thread, not the thread that created the runtime."""
        tls = self.__dict__.setdefault("_tls", threading.local())
        if not getattr(tls, "bound", False):
            self._make_current()
            tls.bound = True

    @abstractmethod
    def _make_current(self) -> None:
        """Make the device current on the calling thread."""

    # ---- to be provided by adapters ------------------------------------------
    @abstractmethod
    def compile(self, source: str, name: str, options: Sequence[str] = ()) -> Module:
        """The module of source (headers inlined), its code from the kernel cache when an earlier
        process compiled the same source with the same compiler and options."""

    @abstractmethod
    def _get_function(self, module: Module, fn: str) -> Any:
        ...

    @abstractmethod
    def malloc(self, nbytes: int) -> DeviceBuffer:
        ...

    @abstractmethod
    def free(self, buf: DeviceBuffer) -> None:
        ...

    @abstractmethod
    def h2d(self, dst: DeviceBuffer, src: np.ndarray) -> None:
        ...

    @abstractmethod
    def d2h(self, dst: np.ndarray, src: DeviceBuffer) -> None:
        ...

    @abstractmethod
    def d2d(self, dst: DeviceBuffer, src: DeviceBuffer, nbytes: int) -> None:
        ...

    @abstractmethod
    def memset32(self, dst: DeviceBuffer, value: int, count: int) -> None:
        ...

    @abstractmethod
    def launch(self, kernel: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
               shared: int = 0, stream: Any = None) -> None:
        ...

    @abstractmethod
    def synchronize(self) -> None:
        ...

    @abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        ...

    @abstractmethod
    def event(self) -> Any:
        ...

    @abstractmethod
    def record(self, ev: Any, stream: Any = None) -> None:
        ...

    @abstractmethod
    def elapsed_ms(self, start: Any, end: Any) -> float:
        ...

    @abstractmethod
    def begin_capture(self, stream: Any = None) -> None:
        ...

    @abstractmethod
    def end_capture(self, stream: Any = None) -> Any:
        """Ends capture and returns an executable graph."""
        ...

    @abstractmethod
    def replay(self, graph: Any, stream: Any = None) -> None:
        ...

    # ---- conveniences shared by both ------------------------------------------
    def upload(self, arr: np.ndarray) -> DeviceBuffer:
        arr = np.ascontiguousarray(arr)
        buf = self.malloc(max(arr.nbytes, 4))
        if arr.nbytes:
            self.h2d(buf, arr)
        return buf

    def download(self, buf: DeviceBuffer, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        if out.nbytes:
            self.d2h(out, buf)
        return out

    def compile_file(self, filename: str, options: Sequence[str] = ()) -> Module:
        # DS4REF_KERNEL_DEFINES="NAME=V ..." sets the kernels' tuning macros (docs/kernels.md),
        # for A/B timing runs: a tuning macro never changes a result bit
        defines = [f"-D{d}" for d in getenv("DS4REF_KERNEL_DEFINES").split()]
        options = (*options, *defines)
        key = (filename, tuple(options))
        cache = self.__dict__.setdefault("_module_cache", {})
        if key not in cache:
            cache[key] = self.compile(load_source(filename), filename, options)
        return cache[key]


# ---------------------------------------------------------------------------
# NVIDIA: cuda-bindings (driver API + NVRTC)
# ---------------------------------------------------------------------------


class CudaRuntime(Runtime):
    kind = "cuda"

    def __init__(self, device: int = 0):
        from cuda.bindings import driver, nvrtc  # noqa: deferred so import never needs CUDA
        self.drv, self.nvrtc = driver, nvrtc
        d = driver
        self._check(d.cuInit(0), "cuInit")
        n = self._check(d.cuDeviceGetCount(), "cuDeviceGetCount")
        if n < 1:
            raise GpuError("cuda: cuDeviceGetCount found no device")
        self.dev = self._check(d.cuDeviceGet(device), "cuDeviceGet")
        self.ctx = self._check(d.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        self._make_current()
        attr = d.CUdevice_attribute

        def get(a, what):
            return int(self._check(d.cuDeviceGetAttribute(a, self.dev), f"cuDeviceGetAttribute({what})"))

        major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cc major")
        minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cc minor")
        raw = self._check(d.cuDeviceGetName(256, self.dev), "cuDeviceGetName")
        name = bytes(raw).split(b"\0")[0].decode(errors="replace")
        total = int(self._check(d.cuDeviceTotalMem(self.dev), "cuDeviceTotalMem"))
        self.info = DeviceInfo("nvidia", name, f"sm_{major}{minor}", total,
                               get(attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE, "warp size"),
                               get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count"),
                               get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, "shared per block"),
                               bool(get(attr.CU_DEVICE_ATTRIBUTE_INTEGRATED, "integrated")))
        self.stream = self._check(d.cuStreamCreate(1), "cuStreamCreate")  # 1 = non-blocking
        # Programmatic dependent launch (sm_90+, ds4_hip.h's DS4_KERNEL_ENTRY): a kernel's blocks
        # may be scheduled while the one before it runs, and wait for it before reading anything
        self.pdl = major >= 9 and getenv("DS4REF_PDL") == "1"
        self._pdl_attrs = []
        if self.pdl:
            a = d.CUlaunchAttribute()
            a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            self._pdl_attrs = [a]

    def _make_current(self) -> None:
        self._check(self.drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def _error_name(self, err):
        try:
            if isinstance(err, self.nvrtc.nvrtcResult):
                return err.name
            r = self.drv.cuGetErrorName(err)
            return r[1].decode() if _status(r[0]) == 0 else repr(err)
        except Exception:  # noqa: BLE001 - naming the error must never hide it
            return repr(err)

    def compile(self, source, name, options=()):
        # NVRTC optimises by default and rejects -O3
        opts = [f"--gpu-architecture={self.info.arch}", "-std=c++17", *NVRTC_EXACT, *options]
        version = self._check(self.nvrtc.nvrtcVersion(), "nvrtcVersion")
        cubin = kernel_cache.compiled(f"nvrtc {version}", opts, source, lambda: self._cubin(source, name, opts))
        handle = self._check(self.drv.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        return Module(self, handle, name, source)

    def _cubin(self, source: str, name: str, opts: Sequence[str]) -> bytes:
        nv = self.nvrtc
        prog = self._check(nv.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []),
                           f"nvrtcCreateProgram({name})")
        try:
            res = nv.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
            if _status(res[0]) != 0:
                raise GpuError(f"cuda: nvrtcCompileProgram({name}) failed:\n{self._log(prog)}")
            size = self._check(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            cubin = bytearray(size)  # a fresh buffer: `b" " * n` can be an interned object NVRTC would write into
            self._check(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return bytes(cubin)
        finally:
            nv.nvrtcDestroyProgram(prog)

    def _log(self, prog) -> str:
        nv = self.nvrtc
        size = self._check(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = bytearray(size)  # never `b" " * size`: for size 1 that is CPython's shared b" ", and NVRTC writes into it
        self._check(nv.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        return log.decode(errors="replace")

    def _get_function(self, module, fn):
        return self._check(self.drv.cuModuleGetFunction(module.handle, fn.encode()),
                           f"cuModuleGetFunction({module.name}:{fn})")

    def malloc(self, nbytes):
        ptr = self._check(self.drv.cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes})")
        return DeviceBuffer(self, int(ptr), nbytes)

    def free(self, buf):
        self._check(self.drv.cuMemFree(self.drv.CUdeviceptr(buf.ptr)), "cuMemFree")
        buf.ptr = 0

    def _dp(self, buf: DeviceBuffer):
        return self.drv.CUdeviceptr(buf.ptr)

    def h2d(self, dst, src):
        src = np.ascontiguousarray(src)
        if src.nbytes > dst.nbytes:
            raise ValueError(f"h2d: {src.nbytes} B do not fit in {dst}")
        self._check(self.drv.cuMemcpyHtoDAsync(self._dp(dst), src.ctypes.data, src.nbytes, self.stream),
                    "cuMemcpyHtoDAsync")
        self.synchronize()  # src may be a temporary: finish before it can be freed

    def d2h(self, dst, src):
        if not dst.flags.c_contiguous or dst.nbytes > src.nbytes:
            raise ValueError(f"d2h: destination must be contiguous and at most {src.nbytes} B")
        self._check(self.drv.cuMemcpyDtoHAsync(dst.ctypes.data, self._dp(src), dst.nbytes, self.stream),
                    "cuMemcpyDtoHAsync")
        self.synchronize()

    def d2d(self, dst, src, nbytes):
        self._check(self.drv.cuMemcpyDtoDAsync(self._dp(dst), self._dp(src), int(nbytes), self.stream),
                    "cuMemcpyDtoDAsync")

    def memset32(self, dst, value, count):
        self._check(self.drv.cuMemsetD32Async(self._dp(dst), int(value) & 0xFFFFFFFF, int(count), self.stream),
                    "cuMemsetD32Async")

    def launch(self, kernel, grid, block, args, shared=0, stream=None):
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        kernel = launch_handle(kernel, args, shared, self.info)
        ptrs, _holders = pack_args(args)  # _holders keep the values alive through the call
        if self.pdl:
            c = self.drv.CUlaunchConfig()
            c.gridDimX, c.gridDimY, c.gridDimZ = g
            c.blockDimX, c.blockDimY, c.blockDimZ = b
            c.sharedMemBytes, c.hStream = int(shared), stream or self.stream
            c.attrs, c.numAttrs = self._pdl_attrs, 1
            self._check(self.drv.cuLaunchKernelEx(c, kernel, ptrs.ctypes.data, 0), "cuLaunchKernelEx")
            return
        self._check(self.drv.cuLaunchKernel(kernel, *g, *b, int(shared), stream or self.stream,
                                            ptrs.ctypes.data, 0), "cuLaunchKernel")

    def synchronize(self):
        self._check(self.drv.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def mem_info(self):
        free, total = self._check(self.drv.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def event(self):
        return self._check(self.drv.cuEventCreate(0), "cuEventCreate")

    def record(self, ev, stream=None):
        self._check(self.drv.cuEventRecord(ev, stream or self.stream), "cuEventRecord")

    def elapsed_ms(self, start, end):
        self._check(self.drv.cuEventSynchronize(end), "cuEventSynchronize")
        return float(self._check(self.drv.cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def begin_capture(self, stream=None):
        mode = self.drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._check(self.drv.cuStreamBeginCapture(stream or self.stream, mode), "cuStreamBeginCapture")

    def end_capture(self, stream=None):
        graph = self._check(self.drv.cuStreamEndCapture(stream or self.stream), "cuStreamEndCapture")
        return self._check(self.drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def replay(self, graph, stream=None):
        self._check(self.drv.cuGraphLaunch(graph, stream or self.stream), "cuGraphLaunch")


# ---------------------------------------------------------------------------
# AMD: hip-python (HIP runtime + HIPRTC). No ROCm device has run it here: every call and
# enum it uses is checked against hip-python's bindings without a GPU (tests/test_hip_python_api.py).
# ---------------------------------------------------------------------------


class HipRuntime(Runtime):
    kind = "hip"

    def __init__(self, device: int = 0):
        from hip import hip, hiprtc  # noqa: deferred; without ROCm the first call fails to dlopen
        self.hip, self.rtc = hip, hiprtc
        n = self._check(hip.hipGetDeviceCount(), "hipGetDeviceCount")
        if n < 1:
            raise GpuError("hip: hipGetDeviceCount found no device")
        self.device = device
        self._make_current()
        props = self._check(hip.hipGetDeviceProperties(device), "hipGetDeviceProperties")
        arch = props.gcnArchName
        arch = (arch.decode() if isinstance(arch, bytes) else str(arch)).split(":")[0]
        name = props.name
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.info = DeviceInfo("amd", name, arch, int(props.totalGlobalMem), int(props.warpSize),
                               int(props.multiProcessorCount), int(props.sharedMemPerBlock), bool(props.integrated))
        self.stream = self._check(hip.hipStreamCreate(), "hipStreamCreate")

    def _make_current(self) -> None:
        self._check(self.hip.hipSetDevice(self.device), "hipSetDevice")

    def _error_name(self, err):
        try:
            if isinstance(err, self.rtc.hiprtcResult):
                return err.name
            return f"{getattr(err, 'name', err)}"
        except Exception:  # noqa: BLE001
            return repr(err)

    def compile(self, source, name, options=()):
        opts = hiprtc_options(self.info.arch, options)
        version = self._check(self.rtc.hiprtcVersion(), "hiprtcVersion")
        code = kernel_cache.compiled(f"hiprtc {version}", opts, source, lambda: self._code(source, name, opts))
        handle = self._check(self.hip.hipModuleLoadData(code), f"hipModuleLoadData({name})")
        return Module(self, handle, name, source)

    def _code(self, source: str, name: str, opts: Sequence[str]) -> bytes:
        rtc = self.rtc
        prog = self._check(rtc.hiprtcCreateProgram(source.encode(), name.encode(), 0, [], []),
                           f"hiprtcCreateProgram({name})")
        try:
            res = rtc.hiprtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
            if _status(res[0]) != 0:
                size = self._check(rtc.hiprtcGetProgramLogSize(prog), "hiprtcGetProgramLogSize")
                log = bytearray(size)
                rtc.hiprtcGetProgramLog(prog, log)
                raise GpuError(f"hip: hiprtcCompileProgram({name}) failed:\n{log.decode(errors='replace')}")
            size = self._check(rtc.hiprtcGetCodeSize(prog), "hiprtcGetCodeSize")
            code = bytearray(size)
            self._check(rtc.hiprtcGetCode(prog, code), "hiprtcGetCode")
            return bytes(code)
        finally:
            rtc.hiprtcDestroyProgram(prog.createRef())

    def _get_function(self, module, fn):
        return self._check(self.hip.hipModuleGetFunction(module.handle, fn.encode()),
                           f"hipModuleGetFunction({module.name}:{fn})")

    def malloc(self, nbytes):
        ptr = self._check(self.hip.hipMalloc(max(int(nbytes), 1)), f"hipMalloc({nbytes})")
        return DeviceBuffer(self, int(ptr), nbytes)

    def free(self, buf):
        self._check(self.hip.hipFree(buf.ptr), "hipFree")
        buf.ptr = 0

    def h2d(self, dst, src):
        src = np.ascontiguousarray(src)
        if src.nbytes > dst.nbytes:
            raise ValueError(f"h2d: {src.nbytes} B do not fit in {dst}")
        kind = self.hip.hipMemcpyKind.hipMemcpyHostToDevice
        self._check(self.hip.hipMemcpyAsync(dst.ptr, src.ctypes.data, src.nbytes, kind, self.stream),
                    "hipMemcpyAsync(H2D)")
        self.synchronize()

    def d2h(self, dst, src):
        if not dst.flags.c_contiguous or dst.nbytes > src.nbytes:
            raise ValueError(f"d2h: destination must be contiguous and at most {src.nbytes} B")
        kind = self.hip.hipMemcpyKind.hipMemcpyDeviceToHost
        self._check(self.hip.hipMemcpyAsync(dst.ctypes.data, src.ptr, dst.nbytes, kind, self.stream),
                    "hipMemcpyAsync(D2H)")
        self.synchronize()

    def d2d(self, dst, src, nbytes):
        kind = self.hip.hipMemcpyKind.hipMemcpyDeviceToDevice
        self._check(self.hip.hipMemcpyAsync(dst.ptr, src.ptr, int(nbytes), kind, self.stream),
                    "hipMemcpyAsync(D2D)")

    def memset32(self, dst, value, count):
        self._check(self.hip.hipMemsetD32Async(dst.ptr, int(value) & 0xFFFFFFFF, int(count), self.stream),
                    "hipMemsetD32Async")

    def launch(self, kernel, grid, block, args, shared=0, stream=None):
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        kernel = launch_handle(kernel, args, shared, self.info)
        ptrs, _holders = pack_args(args)
        self._check(self.hip.hipModuleLaunchKernel(kernel, *g, *b, int(shared), stream or self.stream,
                                                   ptrs.ctypes.data, None), "hipModuleLaunchKernel")

    def synchronize(self):
        self._check(self.hip.hipStreamSynchronize(self.stream), "hipStreamSynchronize")

    def mem_info(self):
        free, total = self._check(self.hip.hipMemGetInfo(), "hipMemGetInfo")
        return int(free), int(total)

    def event(self):
        return self._check(self.hip.hipEventCreate(), "hipEventCreate")

    def record(self, ev, stream=None):
        self._check(self.hip.hipEventRecord(ev, stream or self.stream), "hipEventRecord")

    def elapsed_ms(self, start, end):
        self._check(self.hip.hipEventSynchronize(end), "hipEventSynchronize")
        return float(self._check(self.hip.hipEventElapsedTime(start, end), "hipEventElapsedTime"))

    def begin_capture(self, stream=None):
        mode = self.hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal
        self._check(self.hip.hipStreamBeginCapture(stream or self.stream, mode), "hipStreamBeginCapture")

    def end_capture(self, stream=None):
        graph = self._check(self.hip.hipStreamEndCapture(stream or self.stream), "hipStreamEndCapture")
        return self._check(self.hip.hipGraphInstantiateWithFlags(graph, 0), "hipGraphInstantiateWithFlags")

    def replay(self, graph, stream=None):
        self._check(self.hip.hipGraphLaunch(graph, stream or self.stream), "hipGraphLaunch")


# ---------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------

_ADAPTERS = {"hip": HipRuntime, "cuda": CudaRuntime}
_lock = threading.Lock()
_runtime: Runtime | None = None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"Python bindings not installed ({exc})"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


def get_runtime(force: str | None = None) -> Runtime:
    """The process-wide runtime: a ROCm device first, then NVIDIA.

    force (or env DS4REF_GPU_RUNTIME) = "hip" or "cuda" tries only that one.
    Raises NoGpuError listing each runtime tried and why it failed.
    """
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        choice = (force or getenv(ENV_RUNTIME)).strip().lower()
        if choice and choice not in _ADAPTERS:
            raise NoGpuError(f"{ENV_RUNTIME}={choice!r} is not one of {sorted(_ADAPTERS)}")
        order = [choice] if choice else ["hip", "cuda"]
        failures = []
        for kind in order:
            try:
                _runtime = _ADAPTERS[kind]()
                return _runtime
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                failures.append(f"  {kind}: {_describe(exc)}")
        libs = {"hip": "hip-python (libamdhip64.so, ROCm)", "cuda": "cuda-bindings (libcuda.so, NVIDIA driver)"}
        raise NoGpuError("no usable GPU runtime; tried:\n" + "\n".join(failures)
                         + "\nneeds one of: " + ", ".join(libs[k] for k in order)
                         + f"; force one with {ENV_RUNTIME}=hip|cuda")


def reset_runtime() -> None:
    """Forget the cached runtime (tests)."""
    global _runtime
    with _lock:
        _runtime = None
