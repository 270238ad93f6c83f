"""Our GGUF files in llama.cpp: load them in the llama.cpp that llama-cpp-python 0.3.36 vendors
(its deepseek4 loader) and compare its logits with ds4ref's, position by position.

    python benchmarks/llama_cpp_diff.py [FILE.gguf ...] [--positions 300] [--work /tmp/ds4ref-llama]

Builds llama.cpp once from the PyPI sdist (cmake, CPU, a few minutes on 2 cores) and
benchmarks/llama_cpp_logits.cpp against it, then feeds BOS plus random ids to both engines.
ds4ref runs plain numerics in float64, and official float32 with and without its integer
products (docs/exactness.md section 2a). A foreign engine: the numbers are a tolerance
report, not an equality. Default files: the embedded model, an all-f32 tiny file, and
the q2/q4/mxfp4 policy files (written by python -m ds4ref.gguf.tiny).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from quantised_products import float_path  # noqa: E402  (the same weights, codes hidden)
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


# ds4ref's side of each comparison: plain float64 (the float64 model), and official float32
# with the integer products (the default arithmetic) and without them, so that the two official
# columns differ by the products' arithmetic alone
VARIANTS = {"plain f64": lambda p: _load(p, "plain", np.float64),
            "official f32": lambda p: _load(p, "official", np.float32),
            "official f32, float products": lambda p: float_path(_load(p, "official", np.float32))}


def _load(path, numerics, dtype):
    from ds4ref.model import load
    return load(str(path), numerics=numerics, dtype=dtype)


def compare(tool: Path, path: Path, n: int, work: Path) -> str:
    models = {k: make(path) for k, make in VARIANTS.items()}
    cfg = models["plain f64"].config
    rng = np.random.default_rng(0)
    ids = [int(cfg.bos_id)] + [int(t) for t in rng.integers(10, cfg.vocab_size - 10, n - 1)]
    out = work / "logits.bin"
    subprocess.run([str(tool), str(path), str(out), ",".join(map(str, ids))], check=True, stderr=subprocess.DEVNULL)
    theirs = np.fromfile(out, np.float32).reshape(len(ids), -1)
    cells = []
    for m in models.values():
        ours = np.asarray(m.score(ids), np.float64)
        rel = np.abs(ours - theirs).max(axis=1) / np.abs(ours).max(axis=1)
        cells.append(f"{np.median(rel):.2e} / {np.mean(ours.argmax(1) == theirs.argmax(1)):.0%}")
    return f"| {path.name} | {len(ids)} | " + " | ".join(cells) + " |"


def default_files(work: Path) -> list[Path]:
    from ds4ref.gguf.tiny import default_model_path
    files = [Path(default_model_path()), work / "tiny_f32.gguf"]
    if not files[1].exists():
        subprocess.run([sys.executable, "-m", "ds4ref.gguf.tiny", "--all-f32", "--out", str(files[1])], check=True)
    for policy in ("q2", "q4", "mxfp4"):
        f = work / f"tiny_{policy}.gguf"
        if not f.exists():
            subprocess.run([sys.executable, "-m", "ds4ref.gguf.tiny", "--policy", policy, "--out", str(f)], check=True)
        files.append(f)
    return files


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--positions", type=int, default=300)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ds4ref-llama"))
    args = ap.parse_args()
    tool = build(args.work)
    print("| file | positions | " + " | ".join(f"{k}: median rel. diff / argmax agreement" for k in VARIANTS) + " |")
    print("|---|---|" + "---|" * len(VARIANTS))
    for f in args.files or default_files(args.work):
        print(compare(tool, f, args.positions, args.work), flush=True)


if __name__ == "__main__":
    main()
