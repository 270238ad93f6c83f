"""The kernels built for an AMD GPU without ROCm, as HIPRTC builds them, and what each one needs.

HIPRTC is clang with a built-in header (hiprtc_runtime.h) and the ROCm device libraries linked
as bitcode. Debian's clang-19 has the gfx11 targets, its rocm-device-libs package has the
bitcode, and the PyPI wheel rocm-llvm-python carries ROCm 7.2's own hiprtc_runtime.h, so the
same source, defines and options the runtime hands HIPRTC compile here to the same kind of code
object, whose metadata gives each kernel's registers, scratch and LDS (docs/rocm.md).

    python -m ds4ref.hip.amd_build --arch gfx1151       # every build, a line per kernel

The header is DS4REF_HIPRTC_HEADER's file, else ~/.cache/ds4ref/hiprtc/hiprtc_runtime.h, which
`--wheel-dir D` unpacks from a rocm-llvm-python wheel in D (the tests take it from their cache).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..settings import getenv
from .builds import runtime_builds
from .runtime import hiprtc_options, load_source

CLANG = ("clang-19", "clang")
BITCODE_DIRS = ("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode", "/usr/lib/llvm-19/lib/clang/19/lib/amdgcn/bitcode",
                "/opt/rocm/amdgcn/bitcode")
HEADER = "hiprtc_runtime.h"
HEADER_WHEEL = "rocm_llvm_python-*.whl"
HEADER_IN_WHEEL = "rocm/amd_comgr/hiprtc_runtime.h"
# The device libraries comgr links into every HIPRTC program, with the controls for the
# canonical arithmetic: IEEE square root, denormals kept, no finite-only assumption; wave32.
BITCODE = ("ocml", "ockl", "oclc_finite_only_off", "oclc_unsafe_math_off", "oclc_daz_opt_off",
           "oclc_correctly_rounded_sqrt_on", "oclc_wavefrontsize64_off")
# HIPRTC's own front-end flags before the program's: the header instead of system includes.
HIPRTC_PREAMBLE = ("-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc", "--hip-version=7.2.0",
                   "-DHIP_VERSION_MAJOR=7", "-DHIP_VERSION_MINOR=2", "-DHIP_VERSION_PATCH=0",
                   "-D__HIPCC_RTC__", "-Wno-gnu-line-marker", "-Wno-missing-prototypes")


class MissingToolchain(RuntimeError):
    """What is missing to build for AMD here, and how to install it."""


@dataclass(frozen=True)
class Toolchain:
    clang: str
    bitcode: Path
    header: Path


HEADER_HOME = Path.home() / ".cache" / "ds4ref" / "hiprtc" / HEADER


def unpack_header(wheel_dir: Path, to: Path = HEADER_HOME) -> Path | None:
    """HIPRTC's header from a rocm-llvm-python wheel in wheel_dir, unpacked to `to` (once)."""
    if to.is_file():
        return to
    for wheel in sorted(Path(wheel_dir).glob(HEADER_WHEEL)):
        to.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z, z.open(HEADER_IN_WHEEL) as src:
            tmp = to.with_name(f"{to.name}.{os.getpid()}.tmp")  # test workers unpack at once
            tmp.write_bytes(src.read())
            tmp.replace(to)
        return to
    return None


def find_toolchain(header: Path | None = None) -> Toolchain:
    """clang with the AMD targets, the device bitcode and HIPRTC's header (`header`, else the
    DS4REF_HIPRTC_HEADER setting, else ~/.cache/ds4ref/hiprtc/), or MissingToolchain naming each
    missing piece and its install."""
    missing = []
    clang = next((c for c in CLANG if shutil.which(c) and _has_gfx11(c)), None)
    if clang is None:
        missing.append("clang with the gfx11 targets (apt-get install clang-19)")
    bitcode = next((Path(d) for d in BITCODE_DIRS if (Path(d) / "ocml.bc").is_file()), None)
    if bitcode is None:
        missing.append("the ROCm device bitcode ocml.bc (apt-get install rocm-device-libs)")
    header = Path(header or getenv("DS4REF_HIPRTC_HEADER") or HEADER_HOME)
    if not header.is_file():
        missing.append(f"HIPRTC's {HEADER} at {header} (pip download --no-deps rocm-llvm-python==7.2.2.562.46 "
                       f"-d D, then python -m ds4ref.hip.amd_build --wheel-dir D)")
    if missing:
        raise MissingToolchain("cannot build for AMD: missing " + "; ".join(missing))
    return Toolchain(clang, bitcode, header)


def _has_gfx11(clang: str) -> bool:
    """Whether this clang compiles an empty HIP program for gfx1151."""
    probe = [clang, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc", "--offload-arch=gfx1151",
             "-S", "-o", os.devnull, os.devnull]
    return subprocess.run(probe, capture_output=True).returncode == 0


def clang_command(tc: Toolchain, arch: str, options: Sequence[str], src: Path, out: Path) -> list[str]:
    """The clang line HIPRTC runs for `hiprtc_options(arch, options)`, writing assembly."""
    libs = [a for b in BITCODE for a in ("-Xclang", "-mlink-builtin-bitcode", "-Xclang", str(tc.bitcode / f"{b}.bc"))]
    return [tc.clang, *HIPRTC_PREAMBLE, "-include", str(tc.header), *hiprtc_options(arch, options), *libs,
            "-S", str(src), "-o", str(out)]


class BuildError(RuntimeError):
    """A kernel file did not compile: the message holds the command and clang's log."""


@dataclass(frozen=True)
class KernelResources:
    name: str
    vgpr: int
    sgpr: int
    vgpr_spill: int
    sgpr_spill: int
    scratch: int      # private segment bytes a thread
    lds: int          # static LDS bytes a workgroup
    max_threads: int  # the launch bound a workgroup
    waves: int        # wave32 waves a SIMD holds, the compiler's figure from registers and LDS


@dataclass(frozen=True)
class AmdBuild:
    """One kernel file built for one arch: its assembly and each kernel's resources."""
    filename: str
    arch: str
    options: tuple[str, ...]
    asm: str
    kernels: dict[str, KernelResources]


def compile_file(filename: str, arch: str, options: Sequence[str] = (), tc: Toolchain | None = None) -> AmdBuild:
    """A kernel file built as the runtime builds it, with its kernels' resources."""
    return compile_source(load_source(filename), filename, arch, options, tc)


def compile_source(source: str, filename: str, arch: str, options: Sequence[str] = (),
                   tc: Toolchain | None = None) -> AmdBuild:
    tc = tc or find_toolchain()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / filename, Path(tmp) / (filename + ".s")
        src.write_text(source)
        cmd = clang_command(tc, arch, options, src, out) + ["-Rpass-analysis=kernel-resource-usage"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            raise BuildError(f"{filename} {' '.join(options)} for {arch} failed:\n{run.stderr[-6000:]}")
        asm = out.read_text()
    return AmdBuild(filename, arch, tuple(options), asm, kernel_resources(asm, _occupancy(run.stderr)))


_FIELD = {".vgpr_count": "vgpr", ".sgpr_count": "sgpr", ".vgpr_spill_count": "vgpr_spill",
          ".sgpr_spill_count": "sgpr_spill", ".private_segment_fixed_size": "scratch",
          ".group_segment_fixed_size": "lds", ".max_flat_workgroup_size": "max_threads"}


def _occupancy(remarks: str) -> dict[str, int]:
    """Waves a SIMD by kernel, from clang's kernel-resource-usage remarks."""
    names = re.findall(r"remark: Function Name: (\w+)", remarks)
    waves = re.findall(r"remark:\s+Occupancy \[waves/SIMD\]: (\d+)", remarks)
    return {n: int(w) for n, w in zip(names, waves)}


def kernel_resources(asm: str, occupancy: dict[str, int]) -> dict[str, KernelResources]:
    """Each kernel's resources from the code object's .amdgpu_metadata (its YAML kernel list)."""
    meta = asm.split(".amdgpu_metadata", 1)[1].split(".end_amdgpu_metadata", 1)[0]
    out: dict[str, KernelResources] = {}
    # a kernel is an item of amdhsa.kernels (a "  - " line); its own keys sit 4 columns in,
    # its argument list's deeper; amdhsa.version's items are numbers, not kernels
    for entry in re.split(r"^  - ", meta.split("amdhsa.kernels:", 1)[1], flags=re.M)[1:]:
        fields = dict(re.findall(r"^ {4}(\.[a-z_]+):\s+(\S+)\s*$", "    " + entry, flags=re.M))
        if ".name" not in fields:
            continue
        name = fields[".name"]
        vals = {_FIELD[k]: int(v) for k, v in fields.items() if k in _FIELD}
        out[name] = KernelResources(name, **vals, waves=occupancy[name])
    return out


def kernel_isa(asm: str, kernel: str) -> str:
    """The instructions of one kernel's function body in the assembly."""
    start = asm.index(f"\n{kernel}:")
    end = asm.index(".Lfunc_end", start)
    return asm[start:end]


LDS_PER_WORKGROUP = 65536  # gfx11 and gfx12


def build_all(arch: str, builds=None, jobs: int = 2) -> list[AmdBuild | BuildError]:
    """Every (file, options) build, `jobs` compiles at a time; a build that fails is its BuildError."""
    tc = find_toolchain()
    builds = list(builds if builds is not None else runtime_builds())

    def one(b):
        try:
            return compile_file(b[0], arch, b[1], tc)
        except BuildError as exc:
            return exc
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, builds))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ds4ref.hip.amd_build", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="gfx1151")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--wheel-dir", type=Path, default=None, help="a folder holding a rocm-llvm-python wheel")
    args = p.parse_args(argv)
    if args.wheel_dir is not None and unpack_header(args.wheel_dir) is None:
        p.error(f"no {HEADER_WHEEL} in {args.wheel_dir}")
    print(f"{'kernel':44s} {'build':24s} {'vgpr':>5s} {'waves':>5s} {'scratch':>7s} {'lds':>6s}")
    for b in build_all(args.arch, jobs=args.jobs):
        if isinstance(b, BuildError):
            print(b)
            continue
        for r in b.kernels.values():
            print(f"{r.name:44s} {(b.filename + ' ' + ' '.join(b.options)).strip():24s} {r.vgpr:5d} "
                  f"{r.waves:5d} {r.scratch:7d} {r.lds:6d}")


if __name__ == "__main__":
    main()
