"""What the runtime compiles, in one table: every kernel file once with no macro, and the prompt
GEMM (qgemm.hip) a weight type at a time; beside it, the tuning-macro variants the op twins run
on a GPU. The NVRTC and gfx1151 build tests compile all of them without a GPU, so a variant that
stops building fails CI, not a device run (docs/kernels.md, docs/rocm.md)."""
from __future__ import annotations

from .buffers import KERNEL_DIR

# qgemm.hip's -DQG_BUILD values: ds4_mv3.h's WT_* codes
QG_BUILD = {"q8_0": 3, "q2_k": 4, "q4_k": 5, "iq2_xxs": 6, "mxfp4": 7}

# Tuning macros (DS4REF_KERNEL_DEFINES) the GPU twins set: none changes a bit.
ATTENTION_TUNING = ("AT_KT=8", "AT_HPW=2", "AT_KT=8 AT_HPW=2", "AT_KT=4", "AT_SLD=1", "AT_SLD=3 AT_KT=8")
ATTENTION_COMBINE_TUNING = "AT_CZ=2"
EXPERT_LIST_TUNING = "EL_CHUNK_WORDS=1"  # step_expert_list's lanes in chunks of 32
# qgemm: (macros, weight types). QG_DOT4=1 is AMD's default and NVIDIA's forced twin of it.
QGEMM_TUNING = (("QG_AHEAD=2", ("q8_0", "q2_k", "iq2_xxs")),
                ("QG_AHEAD=3 QG_MIN_BLOCKS=2", ("q8_0", "q2_k", "iq2_xxs")),
                ("QG_DOT4=1", tuple(QG_BUILD)),
                ("QG_DOT4=1 QG_AHEAD=2", ("q2_k", "iq2_xxs")))
NVIDIA_ONLY = "QG_DOT4"  # on AMD the dot4 tiles are the only path, so these variants are its default


def kernel_files() -> list[str]:
    return sorted(p.name for p in KERNEL_DIR.glob("*.hip"))


def defines(macros: str) -> tuple[str, ...]:
    """'A=1 B=2' as compiler options."""
    return tuple(f"-D{m}" for m in macros.split())


def qgemm_options(wtype: str) -> tuple[str, ...]:
    return (f"-DQG_BUILD={QG_BUILD[wtype]}",)


def runtime_builds() -> list[tuple[str, tuple[str, ...]]]:
    """(file, options) of every module the backends compile (with no DS4REF_KERNEL_DEFINES)."""
    return [(f, ()) for f in kernel_files() if f != "qgemm.hip"] + \
           [("qgemm.hip", qgemm_options(w)) for w in QG_BUILD]


def qgemm_tuning_cases() -> list[tuple[str, str]]:
    """(macros, weight type) of each tuned qgemm build."""
    return [(m, w) for m, types in QGEMM_TUNING for w in types]


def tuning_builds(vendor: str = "nvidia") -> list[tuple[str, tuple[str, ...]]]:
    """(file, options) of every tuning variant the GPU twins compile on `vendor` ("nvidia", "amd")."""
    builds = [("step_state.hip", defines(m)) for m in (*ATTENTION_TUNING, ATTENTION_COMBINE_TUNING)]
    builds.append(("step_ops.hip", defines(EXPERT_LIST_TUNING)))
    builds += [("qgemm.hip", qgemm_options(w) + defines(m)) for m, w in qgemm_tuning_cases()
               if vendor == "nvidia" or NVIDIA_ONLY not in m]
    return builds
