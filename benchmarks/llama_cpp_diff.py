"""Our GGUF files in llama.cpp: load them in the llama.cpp that llama-cpp-python 0.3.36 vendors
(its deepseek4 loader) and compare its logits with ds4ref's, position by position.

    python benchmarks/llama_cpp_diff.py [FILE.gguf ...] [--positions 300] [--work /tmp/ds4ref-llama]

Builds llama.cpp once from the PyPI sdist (cmake, CPU, a few minutes on 2 cores) and
benchmarks/llama_cpp_logits.cpp against it, then feeds BOS plus random ids to both engines.
ds4ref runs plain numerics in float64. A foreign engine: the numbers are a tolerance
report, not an equality. Default files: the embedded model, an all-f32 tiny file, and
the q2/q4/mxfp4 policy files (written by python -m ds4ref.tiny).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SDIST = "llama-cpp-python==0.3.36"


def build(work: Path) -> Path:
    tool = work / "llama_cpp_logits"
    if tool.exists():
        return tool
    work.mkdir(parents=True, exist_ok=True)
    src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if src is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        SDIST, "-d", str(work)], check=True)
        subprocess.run(["tar", "xzf", str(next(work.glob("llama_cpp_python-*.tar.gz"))), "-C", str(work)], check=True)
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    bld = work / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(bld), "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(bld), "-j2", "--target", "llama"], check=True, stdout=subprocess.DEVNULL)
    lib = bld / "bin"
    subprocess.run(["g++", "-O2", "-std=c++17", str(ROOT / "benchmarks" / "llama_cpp_logits.cpp"),
                    f"-I{src}/include", f"-I{src}/ggml/include", f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
                    f"-Wl,-rpath,{lib}", "-o", str(tool)], check=True)
    return tool


def compare(tool: Path, path: Path, n: int, work: Path) -> str:
    from ds4ref.model import load
    model = load(str(path), numerics="plain", dtype=np.float64)
    rng = np.random.default_rng(0)
    ids = [int(model.config.bos_id)] + [int(t) for t in rng.integers(10, model.config.vocab_size - 10, n - 1)]
    out = work / "logits.bin"
    subprocess.run([str(tool), str(path), str(out), ",".join(map(str, ids))], check=True, stderr=subprocess.DEVNULL)
    theirs = np.fromfile(out, np.float32).reshape(len(ids), -1)
    ours = np.asarray(model.score(ids))
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(ours).max(axis=1)
    return (f"| {path.name} | {len(ids)} | {rel[0]:.2e} | {np.median(rel):.2e} | {rel.max():.3f} | "
            f"{np.mean(ours.argmax(1) == theirs.argmax(1)):.1%} |")


def default_files(work: Path) -> list[Path]:
    from ds4ref.tiny import default_model_path
    files = [Path(default_model_path()), work / "tiny_f32.gguf"]
    if not files[1].exists():
        subprocess.run([sys.executable, "-m", "ds4ref.tiny", "--all-f32", "--out", str(files[1])], check=True)
    for policy in ("q2", "q4", "mxfp4"):
        f = work / f"tiny_{policy}.gguf"
        if not f.exists():
            subprocess.run([sys.executable, "-m", "ds4ref.tiny", "--policy", policy, "--out", str(f)], check=True)
        files.append(f)
    return files


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--positions", type=int, default=300)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ds4ref-llama"))
    args = ap.parse_args()
    tool = build(args.work)
    print("| file | positions | rel. diff, position 0 | median | max | argmax agreement |")
    print("|---|---|---|---|---|---|")
    for f in args.files or default_files(args.work):
        print(compare(tool, f, args.positions, args.work), flush=True)


if __name__ == "__main__":
    main()
