"""Registers, shared memory and the SASS instruction mix of chosen kernels, on a machine
without a GPU: NVRTC builds the kernel file for sm_90 with the canonical arithmetic's
options (as the runtime does), and cuobjdump disassembles the cubin.

cuobjdump is not on PyPI by itself; Triton's wheel carries it. Unpack it once:

    pip download --no-deps triton -d /tmp/tw && unzip -o -q /tmp/tw/triton-*.whl \
        'triton/backends/nvidia/bin/*' -d /tmp/tw/x
    python benchmarks/sass_stats.py qdot.hip ds4_qexperts_iq2_xxs_r2 \
        --cuobjdump /tmp/tw/x/triton/backends/nvidia/bin/cuobjdump [--define MQ_AHEAD=4]

Counts are static (each instruction of the code once, unrolled loops as unrolled), so they
compare two versions of one kernel, not times; ncu (benchmarks/ncu_ops.sh) gives the executed mix.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ds4ref.hip.runtime import NVRTC_EXACT, load_source


def cubin(filename: str, defines: list[str], arch: str = "sm_90") -> bytes:
    from cuda.bindings import nvrtc
    err, prog = nvrtc.nvrtcCreateProgram(load_source(filename).encode(), filename.encode(), 0, [], [])
    opts = [f"--gpu-architecture={arch}", "-std=c++17", *NVRTC_EXACT, *(f"-D{d}" for d in defines)]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise SystemExit(f"{filename} did not compile:\n{log.decode(errors='replace')}")
    _, n = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, buf)
    return buf


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="kernel file under ds4ref/hip/kernels, e.g. qdot.hip")
    ap.add_argument("kernels", nargs="+", help="kernel names (extern \"C\")")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE, as DS4REF_KERNEL_DEFINES sets")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin(args.file, args.define))
        run = lambda *a: subprocess.run([args.cuobjdump, *a, str(path)], capture_output=True, text=True, check=True).stdout
        usage = run("-res-usage")
        for name in args.kernels:
            m = re.search(rf"Function {re.escape(name)}:\s*\n\s*(REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+)", usage)
            if not m:
                sys.exit(f"{name} is not in {args.file}")
            ops = collections.Counter()
            for line in run("-sass", "-fun", name).splitlines():
                ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
                if ins:
                    ops[ins.group(2)] += 1
            print(f"{name}: {m.group(1)}; {sum(ops.values())} instructions")
            for op, n in ops.most_common(args.top):
                print(f"  {n:6d}  {op}")


if __name__ == "__main__":
    main()
