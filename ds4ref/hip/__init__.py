"""The GPU fast path: a small runtime (HIP or CUDA), kernels in the HIP dialect, op twins.

Importing this package needs no GPU library; `get_runtime()` raises NoGpuError
with the reasons when no runtime can be opened.
"""
from .runtime import DeviceInfo, GpuError, NoGpuError, get_runtime  # noqa: F401
