"""Guardrails for the GPU path: fail closed, and say what is supported.

* no GPU runtime            -> NoGpuError (from runtime.get_runtime), listing what was tried
* a ROCm device other than gfx1151 -> UnsupportedDeviceError unless allow_untested_arch
  (CLI: --allow-untested-arch); any device whose warp is not 32 lanes is refused outright,
  because every kernel's reductions assume 32-lane warps
* a weight type the kernels cannot read -> UnsupportedWeightError naming the tensor
* DeviceMemoryError: raised by HipBackend.configure, before anything is allocated, when the
  state and the largest pass's workspace exceed free memory (the server's memory plan,
  ds4ref/paging/plan.py, refuses a configuration that cannot fit before loading anything)
"""
from __future__ import annotations

import argparse
from typing import Mapping

SUPPORTED_ROCM_ARCHS = ("gfx1151",)
# Weight encodings the matvec kernels read (GGML type names).
SUPPORTED_WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "MXFP4", "I32")


class UnsupportedDeviceError(RuntimeError):
    """The device is not one the kernels were validated on."""


class UnsupportedWeightError(ValueError):
    """A tensor's encoding has no kernel."""


class DeviceMemoryError(RuntimeError):
    """The configuration needs more device memory than is free."""


# An APU's GPU (Strix Halo) sees the BIOS carve-out plus the GTT, whose default limit on Linux is
# about half of RAM. The TTM limits raise it; both are counted in 4 KiB pages (docs/rocm.md).
TTM_PAGE = 4096
APU_HEADROOM = 4 << 30  # the desktop and the kernel keep some of RAM for themselves


def memory_advice(info, need: int) -> str:
    """What to change so that `need` bytes fit on this device: on an APU the carve-out and the
    kernel's GTT limit (the settings a Strix Halo owner changes), elsewhere the serving flags."""
    if getattr(info, "vendor", "") == "amd" and getattr(info, "integrated", False):
        pages = -(-(need + APU_HEADROOM) // TTM_PAGE)
        gib = -(-(need + APU_HEADROOM) // (1 << 30))
        return (f"{info.name} is an APU: its GPU memory is system RAM made visible to it (now "
                f"{info.total_bytes / 2**30:.1f} GiB). Give the GPU at least {gib} GiB: boot with the kernel "
                f"parameters ttm.pages_limit={pages} ttm.page_pool_size={pages} and keep the BIOS "
                f"carve-out (UMA frame buffer) at 512 MB, or set that carve-out to {gib} GiB or more; "
                f"do not also set amdgpu.gttsize (docs/rocm.md)")
    return "use fewer slots or pages (--max-concurrency, --max-context, --kv-pool-tokens)"


def check_fits_device(rt, need: int, what: str) -> None:
    """Refuse, before allocating, `need` bytes of `what` that would not fit the free device memory."""
    free, _total = rt.mem_info()
    if need > 0.95 * free:
        raise DeviceMemoryError(f"{what} need {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB of "
                                f"{rt.info.name} is free; {memory_advice(rt.info, need)}")


def check_device(info, allow_untested_arch: bool = False) -> None:
    """info: anything with vendor, arch, name, warp_size (runtime.DeviceInfo)."""
    if int(info.warp_size) != 32:
        raise UnsupportedDeviceError(
            f"{info.name} ({info.arch}) runs {info.warp_size}-lane warps; the ds4ref kernels need 32-lane "
            f"warps (gfx1151 wave32 or NVIDIA)")
    if info.vendor == "amd" and info.arch not in SUPPORTED_ROCM_ARCHS:
        if not allow_untested_arch:
            raise UnsupportedDeviceError(
                f"ROCm device {info.name} is {info.arch}; ds4ref's HIP kernels are validated on "
                f"{', '.join(SUPPORTED_ROCM_ARCHS)} only. Pass allow_untested_arch=True "
                f"(--allow-untested-arch) to run anyway")
    elif info.vendor not in ("amd", "nvidia"):
        raise UnsupportedDeviceError(f"unknown GPU vendor {info.vendor!r} for {info.name}")


def check_weight_types(weight_types: Mapping[str, str]) -> None:
    """weight_types: tensor name -> GGML type name. Refuses the first unsupported one."""
    for name, wtype in weight_types.items():
        if wtype.upper() not in SUPPORTED_WEIGHT_TYPES:
            raise UnsupportedWeightError(
                f"tensor {name!r} is {wtype}; the GPU kernels read {', '.join(SUPPORTED_WEIGHT_TYPES)} "
                f"(convert it, or use the NumPy backend)")


def add_guard_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-untested-arch", action="store_true",
                        help=f"run on a ROCm device other than {', '.join(SUPPORTED_ROCM_ARCHS)}")


def open_device(allow_untested_arch: bool = False):
    """get_runtime() then check_device(); the one entry the GPU backend uses."""
    from .runtime import get_runtime
    rt = get_runtime()
    check_device(rt.info, allow_untested_arch)
    return rt
