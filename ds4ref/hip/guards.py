"""Guardrails for the GPU path: fail closed, and say what is supported.

* no GPU runtime            -> NoGpuError (from runtime.get_runtime), listing what was tried
* a ROCm device other than gfx1151 -> UnsupportedDeviceError unless allow_untested_arch
  (CLI: --allow-untested-arch); any device whose warp is not 32 lanes is refused outright,
  because every kernel's reductions assume 32-lane warps
* a weight type the kernels cannot read -> UnsupportedWeightError naming the tensor
* a configuration whose device memory estimate exceeds free memory -> DeviceMemoryError,
  raised before anything is allocated
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..backend import MAX_ROWS
from ..config import DS4Config
from ..paging.layout import PageLayout
from ..tensors import tensor_shapes

SUPPORTED_ROCM_ARCHS = ("gfx1151",)
# Weight encodings the matvec kernels read (GGML type names).
SUPPORTED_WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "MXFP4", "I32")

# bytes per block, values per block, for every GGML type a DS4 GGUF may hold
_TYPE_BLOCK = {
    "F32": (4, 1), "F16": (2, 1), "BF16": (2, 1), "I32": (4, 1),
    "Q8_0": (34, 32), "Q4_K": (144, 256), "Q2_K": (84, 256), "IQ2_XXS": (66, 256), "MXFP4": (17, 32),
}


class UnsupportedDeviceError(RuntimeError):
    """The device is not one the kernels were validated on."""


class UnsupportedWeightError(ValueError):
    """A tensor's encoding has no kernel."""


class DeviceMemoryError(RuntimeError):
    """The configuration needs more device memory than is free."""


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


def check_hash_routes(name: str, tid2eid) -> None:
    """The expert kernels list each expert once per lane (step_expert_list): a hash route
    naming one expert twice for a token would lose that choice's output. Published tables
    are permutations; refuse any other."""
    ids = np.sort(np.asarray(tid2eid), axis=1)
    repeated = ids[:, 1:] == ids[:, :-1]
    tokens = np.flatnonzero(repeated.any(axis=1))
    if tokens.size:
        tok = int(tokens[0])
        expert = int(ids[tok, 1:][repeated[tok]][0])
        raise UnsupportedWeightError(f"tensor {name!r}: token {tok} routes to expert {expert} twice; the GPU "
                                     f"expert kernels take distinct experts per token (use the NumPy backend)")


def tensor_bytes(shape, wtype: str) -> int:
    key = wtype.upper()
    if key not in _TYPE_BLOCK:
        raise UnsupportedWeightError(f"unknown weight type {wtype!r} (known: {', '.join(_TYPE_BLOCK)})")
    bpb, vpb = _TYPE_BLOCK[key]
    n = 1
    for s in shape:
        n *= int(s)
    if shape and int(shape[-1]) % vpb:
        raise UnsupportedWeightError(f"row length {shape[-1]} is not a multiple of the {wtype} block {vpb}")
    return n // vpb * bpb


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    paged: int          # compressed KV rows + indexer rows, all pages
    per_slot: int       # raw ring + compressor state, all slots
    workspace: int      # per-pass activations and logits for MAX_ROWS rows

    @property
    def total(self) -> int:
        return self.weights + self.paged + self.per_slot + self.workspace


def estimate_device_bytes(config: DS4Config, weight_types: Mapping[str, str], n_slots: int, n_pages: int,
                          page_tokens: int = 128, state_bytes: int = 4) -> MemoryEstimate:
    """Bytes the GPU backend needs. weight_types maps tensor name -> GGML type; a "*" entry is
    the default for names not listed (else a missing name is an error)."""
    weights = 0
    for name, shape in tensor_shapes(config).items():
        wtype = weight_types.get(name, weight_types.get("*"))
        if wtype is None:
            raise UnsupportedWeightError(f"no weight type given for tensor {name!r}")
        weights += tensor_bytes(shape, wtype)
    layout = PageLayout(config, page_tokens)
    paged = n_pages * layout.page_elements() * state_bytes
    per_slot = n_slots * layout.slot_elements() * state_bytes
    # the widest per-row activations: hc streams and the logits row
    workspace = MAX_ROWS * (config.hc_dim + config.vocab_size) * 4
    return MemoryEstimate(weights, paged, per_slot, workspace)


def check_fits(estimate: MemoryEstimate, free_bytes: int, reserve: float = 0.05) -> None:
    """Refuse before allocating when the estimate exceeds free memory less a reserve fraction."""
    budget = int(free_bytes * (1.0 - reserve))
    if estimate.total > budget:
        gib = 1 << 30
        raise DeviceMemoryError(
            f"needs {estimate.total / gib:.2f} GiB (weights {estimate.weights / gib:.2f}, paged history "
            f"{estimate.paged / gib:.2f}, per-slot state {estimate.per_slot / gib:.2f}, workspace "
            f"{estimate.workspace / gib:.2f}) but only {budget / gib:.2f} GiB of device memory is usable; "
            f"use fewer slots or pages")


def add_guard_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-untested-arch", action="store_true",
                        help=f"run on a ROCm device other than {', '.join(SUPPORTED_ROCM_ARCHS)}")


def open_device(allow_untested_arch: bool = False):
    """get_runtime() then check_device(); the one entry the GPU backend uses."""
    from .runtime import get_runtime
    rt = get_runtime()
    check_device(rt.info, allow_untested_arch)
    return rt
