"""What ds4ref predicts for Flash on a Strix Halo (gfx1151), from this machine: the bytes a decode
pass reads by weight family and its floor at 212 GB/s for C = 1, 4 and 16, and the hot kernels'
gfx1151 resources and instruction mix from their code objects. A gpu_check.sh report from a Strix
Halo is held against these tables (docs/rocm.md).

    python -m ds4ref.hip.amd_build --wheel-dir D    # once: HIPRTC's header from the rocm-llvm-python wheel in D
    python benchmarks/gfx1151_prediction.py --out docs/results/gfx1151_prediction.md
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict

from ds4ref.gguf import tiny
from ds4ref.gguf.tensors import tensor_shapes
from ds4ref.hip import amd_build
from ds4ref.hip.builds import qgemm_options

BANDWIDTH = 212e9  # Strix Halo's measured copy bandwidth (docs/rocm.md), bytes a second
# stored bytes a weight of each type (GGUF blocks)
BYTES_PER_WEIGHT = {"F32": 4, "F16": 2, "BF16": 2, "Q8_0": 34 / 32, "Q2_K": 84 / 256, "IQ2_XXS": 66 / 256}
LANES = (1, 4, 16)
CONTEXT = 4096


def family(suffix: str, qtype: str) -> str:
    if suffix == "ffn_down_exps.weight":
        return f"routed experts down ({qtype})"
    if suffix in tiny._EXPERTS:
        return f"routed experts gate, up ({qtype})"
    return f"dense {qtype}"


def pass_bytes(cfg) -> dict[str, list[float]]:
    """Bytes a decode pass of C rows reads by family: dense weights once, the routed experts the
    distinct ones C rows choose under uniform routing (as benchmarks/decode_gpu.py counts)."""
    gate_up, down = tiny.POLICIES["q2"]
    dtypes = tiny.tiny_dtypes(cfg)
    out: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(LANES))
    for name, shape in tensor_shapes(cfg).items():
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        n = 1
        for s in shape:
            n *= s
        if len(shape) < 2 or name == "token_embd.weight":
            continue  # vectors, and the embedding's C rows: under a megabyte a pass
        qtype = (down if suffix == "ffn_down_exps.weight" else gate_up) if suffix in tiny._EXPERTS \
            else dtypes.get(name, "f32").upper()
        nbytes = n * BYTES_PER_WEIGHT[qtype]
        for i, C in enumerate(LANES):
            if suffix in tiny._EXPERTS:
                distinct = cfg.n_expert * (1 - (1 - cfg.n_expert_used / cfg.n_expert) ** C)
                out[family(suffix, qtype)][i] += nbytes * distinct / cfg.n_expert
            else:
                out[family(suffix, qtype)][i] += nbytes
    return dict(out)


HOT = [("qdot.hip", (), r"ds4_(qmatvec_q8_0_r2|qexperts_iq2_xxs_r2|qexperts_q2_k_r2)$"),
       ("matvec.hip", (), r"ds4_matvec3_f16_r1$"),
       ("step_state.hip", (), r"step_attention_split$"),
       ("hc.hip", (), r"ds4_hc_pre_finish$"),
       ("qgemm.hip", qgemm_options("iq2_xxs"), r"ds4_qgemm_iq2_xxs$")]
CLASSES = (("v_dot4", r"v_dot4"), ("VALU", r"v_"), ("SALU", r"s_(?!waitcnt|barrier|cbranch|branch)"),
           ("LDS", r"ds_"), ("global", r"global_|buffer_"), ("branch", r"s_c?branch"), ("wait", r"s_waitcnt"))


def instruction_mix(isa: str) -> dict[str, int]:
    lines = [l.split()[0] for l in isa.splitlines() if l.startswith("\t") and not l.startswith("\t.")
             and l.split() and not l.split()[0].startswith(";")]
    mix = {}
    for label, pat in CLASSES:
        mix[label] = sum(1 for op in lines if re.match(pat, op))
    mix["VALU"] -= mix["v_dot4"]
    mix["all"] = len(lines)
    return mix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = tiny.flash_config(43, n_expert=256, context_length=1048576)
    rows = ["| weights read by a decode pass | " + " | ".join(f"C = {c}, GB" for c in LANES) + " |",
            "|---|" + "---|" * len(LANES)]
    total = [0.0] * len(LANES)
    for fam, b in sorted(pass_bytes(cfg).items(), key=lambda kv: -kv[1][-1]):
        rows.append(f"| {fam} | " + " | ".join(f"{x / 1e9:.2f}" for x in b) + " |")
        total = [t + x for t, x in zip(total, b)]
    rows.append("| **all weights** | " + " | ".join(f"**{x / 1e9:.2f}**" for x in total) + " |")
    rows.append("| floor at 212 GB/s, weights alone, ms | " + " | ".join(f"{x / BANDWIDTH * 1e3:.1f}" for x in total) + " |")
    rows.append("| tok/s at that floor | " + " | ".join(f"{c / (x / BANDWIDTH):.0f}" for c, x in zip(LANES, total)) + " |")
    rows += ["", "| kernel (gfx1151) | VGPRs | waves/SIMD | LDS B | " + " | ".join(c for c, _ in CLASSES) + " | all |",
             "|---|---|---|---|" + "---|" * (len(CLASSES) + 1)]
    tc = amd_build.find_toolchain()
    for f, opts, pat in HOT:
        b = amd_build.compile_file(f, "gfx1151", opts, tc)
        for k in sorted(k for k in b.kernels if re.search(pat, k)):
            r, mix = b.kernels[k], instruction_mix(amd_build.kernel_isa(b.asm, k))
            rows.append(f"| {k} | {r.vgpr} | {r.waves} | {r.lds} | " + " | ".join(str(mix[c]) for c, _ in CLASSES)
                        + f" | {mix['all']} |")
    text = "\n".join(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(f"Generated by `python benchmarks/gfx1151_prediction.py` (Flash 43 layers, q2 policy; "
                     f"instruction counts are static, in the code object).\n\n{text}\n")


if __name__ == "__main__":
    main()
