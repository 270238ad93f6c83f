"""Every DS4REF_* environment variable the package reads, in one table: its default and what it
changes. Modules read them through `getenv`, never os.environ, so this table is the whole list
(tinygrad's getenv, with the names written down). None of them changes a result: they choose
kernels, tuning and output, and the canonical arithmetic is the same under every choice.
The test suite reads its own variables (the backend under test, the asset cache) in tests/.

    python -m ds4ref.settings        # the table, with the values in force
"""
from __future__ import annotations

import os

SETTINGS: dict[str, tuple[str | None, str]] = {
    "DS4REF_API_KEY": (None, "the server's API key (--api-key's default); unset: the API is open"),
    "DS4REF_PROGRESS": ("1", "0 hides the progress bars (weight upload, conversion, compiles)"),
    "DS4REF_GPU_RUNTIME": ("", "hip or cuda: the GPU runtime to open; empty: the first that works"),
    "DS4REF_KERNEL_DEFINES": ("", "extra -DNAME=VALUE macros for every kernel compile (tuning experiments)"),
    "DS4REF_HIPRTC_HEADER": ("", "HIPRTC's hiprtc_runtime.h for the offline AMD build (hip/amd_build.py); empty: "
                             "~/.cache/ds4ref/hiprtc/, where amd_build --wheel-dir unpacks it"),
    "DS4REF_KERNEL_CACHE": ("", "folder of compiled kernels (hip/kernel_cache.py); empty: ~/.cache/ds4ref/kernels; off: none"),
    "DS4REF_MATVEC_RPW": ("", "forces the matvec's rows per warp (1, 2 or 4); empty: by shape"),
    "DS4REF_PREFILL_RPW": ("2", "the matvec's rows per warp in prompt passes"),
    "DS4REF_EXPERT_RPW": ("2", "routed-expert rows per warp in decode passes"),
    "DS4REF_PREFILL_EXPERT_RPW": ("4", "routed-expert rows per warp in prompt passes (4 for bf16 only)"),
    "DS4REF_HIP_GRAPH": ("1", "0 runs the HIP pass launch by launch instead of replaying its captured graph"),
    "DS4REF_PDL": ("0", "1 launches kernels with programmatic dependent launch (NVIDIA sm_90+)"),
    "DS4REF_COMPACT_KV": ("1", "0 keeps official numerics' KV and indexer rows as float32 on the GPU (and in its memory plan)"),
}


def getenv(name: str) -> str | None:
    """The setting's value: the environment's, else its default."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a ds4ref setting; the settings are {', '.join(sorted(SETTINGS))}")
    return os.environ.get(name, SETTINGS[name][0])


def getenv_int(name: str) -> int:
    value = getenv(name)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not an integer") from None


def main() -> None:
    for name, (default, what) in SETTINGS.items():
        now = "(secret)" if name == "DS4REF_API_KEY" and os.environ.get(name) else os.environ.get(name, "")
        print(f"{name:28s} default {default!r:6s} now {now!r:8s} {what}")


if __name__ == "__main__":
    main()
