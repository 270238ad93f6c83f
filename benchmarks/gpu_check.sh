#!/usr/bin/env bash
# The one device run: build every kernel, check the GPU path bit for bit against the
# NumPy reference, and time it, on NVIDIA (CUDA) or AMD (ROCm), whichever the runtime opens
# (docs/rocm.md for a Strix Halo). On the lent NVIDIA machine, with carry [".whl"] (the wheels of
# benchmarks/device_wheels.txt, fetched by benchmarks/fetch_device_wheels.sh); the tiny policy
# files are generated there, byte-identical to the goldens' (tests/test_tiny.py checks):
#   bash benchmarks/gpu_check.sh
# STAGES picks any of fresh,build,ops,backend,draft,golden,serve,decode,prefill,hf,full,fullprefill,prefix,profile,spec,launch
# (default: all but fresh, prefix, profile, spec and launch; on ROCm also without hf). Logs and tables land
# under $OUT, and $OUT/report.md gathers them (the device tool brings $OUT back).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ds4ref_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
# The runtime get_runtime() opens (ROCm first, then CUDA), unless DS4REF_GPU_RUNTIME names one
if [ -z "${DS4REF_GPU_RUNTIME:-}" ]; then
  DS4REF_GPU_RUNTIME=$(python3 -c 'from ds4ref.hip.runtime import get_runtime; print(get_runtime().kind)' 2>"$OUT/runtime.log") \
    || { echo "no GPU runtime opened:"; cat "$OUT/runtime.log"; exit 1; }
fi
export DS4REF_GPU_RUNTIME
if [ "$DS4REF_GPU_RUNTIME" = hip ]; then
  STAGES=${STAGES:-build,ops,backend,draft,golden,serve,decode,prefill,full,fullprefill}
else
  STAGES=${STAGES:-build,ops,backend,draft,golden,serve,decode,prefill,hf,full,fullprefill}
fi
# Stage time limits are the H200's; a Strix Halo's memory is about 20x slower, so ROCm runs get 10x
SLOW=${SLOW:-$([ "$DS4REF_GPU_RUNTIME" = hip ] && echo 10 || echo 1)}
t() { echo $(( $1 * SLOW )); }
CORES=$(nproc)
WORKERS=${WORKERS:-$(( CORES > 15 ? 14 : CORES - 1 ))}  # pytest-xdist workers: the NumPy side of the cross-backend property
FRESH_WORKERS=${FRESH_WORKERS:-$(( WORKERS > 12 ? 12 : WORKERS ))}
export DS4REF_GPU_EXAMPLES=${DS4REF_GPU_EXAMPLES:-12} DS4REF_HYPOTHESIS_NO_SHRINK=${DS4REF_HYPOTHESIS_NO_SHRINK:-1}
export DS4REF_CROSS_SHARDS=${DS4REF_CROSS_SHARDS:-14} DS4REF_CROSS_EXAMPLES=${DS4REF_CROSS_EXAMPLES:-15}
rc=0
T0=$SECONDS
stage() { echo "== [$((SECONDS - T0)) s] $*"; }
has() { [[ ,$STAGES, == *,$1,* ]]; }
PYTEST="python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider -p no:benchmark"
{ echo "runtime $DS4REF_GPU_RUNTIME; stages $STAGES; $CORES cores"
  python3 -c "from ds4ref.hip.runtime import get_runtime; print(get_runtime().info)"
  if [ "$DS4REF_GPU_RUNTIME" = hip ]; then
    (rocminfo | grep -m3 -E 'Marketing Name|gfx[0-9]') ; (cat /opt/rocm/.info/version 2>/dev/null || true)
    python3 -c "import importlib.metadata as m; print('hip-python', m.version('hip-python'))"
    grep -o 'ttm[^ ]*\|amdgpu.gttsize[^ ]*' /proc/cmdline || echo "no ttm / gttsize kernel parameters"
    free -g | head -2
  else
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
    python3 -c "import cuda.bindings as c; print('cuda-bindings', c.__version__)"
  fi
  python3 -c "import sys, numpy, numba; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__)"
  git rev-parse HEAD 2>/dev/null; } 2>&1 | tee "$OUT/env.log"

if has fresh; then
  # The README's install and test command on this machine, in a new venv: pip installs the
  # project from the carried wheels (no index reaches this machine); numpy, numba, hypothesis
  # and the rest of the image's packages are seen through the venv's site path.
  stage "fresh venv: pip install -e '.[test]' (offline, from .whl), then python -m pytest -n $FRESH_WORKERS"
  ( unset PYTHONPATH
    rm -rf /tmp/freshvenv && python3 -m venv --system-site-packages /tmp/freshvenv || exit 1
    site=$(python3 -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
    /tmp/freshvenv/bin/python -c 'import numpy' 2>/dev/null \
      || echo "$site" > "$(/tmp/freshvenv/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
    /tmp/freshvenv/bin/python -m pip install -q --no-index --find-links .whl -e '.[test]' || exit 1
    timeout ${FRESH_TIMEOUT:-$(t 400)} /tmp/freshvenv/bin/python -m pytest -n "$FRESH_WORKERS" -q -p no:cacheprovider \
      -p no:benchmark -rfEs --tb=short ) 2>&1 | tee "$OUT/fresh.log" || rc=1
fi
if has build; then
  stage "build: compile every kernel file"
  timeout $(t 150) python3 - <<'PY' 2>&1 | tee "$OUT/build.log" || { echo "BUILD FAILED"; exit 1; }
import time
from ds4ref.hip.runtime import get_runtime, KERNEL_DIR
rt = get_runtime()
print("runtime", rt.kind, rt.info)
for f in sorted(KERNEL_DIR.glob("*.hip")):
    t = time.time(); rt.compile_file(f.name); print(f"compiled {f.name} in {time.time() - t:.2f} s")
PY
fi
if has ops; then
  stage "op twins, bitwise (the op-case table, ds4ref/harness/op_cases.py)"
  timeout ${OPS_TIMEOUT:-$(t 240)} $PYTEST -m gpu tests/gpu/test_ops_gpu.py -n 4 2>&1 | tee "$OUT/ops.log" || rc=1
  stage "op timings against the bandwidth floor (the same table's perf mode)"
  timeout ${OPS_PERF_TIMEOUT:-$(t 240)} python3 benchmarks/ops_gpu.py --out "$OUT/perf_ops_gpu.md" 2>&1 \
    | tee "$OUT/ops_perf.log" || rc=1
fi
if has backend; then
  stage "HipBackend vs NumpyBackend, bitwise ($DS4REF_CROSS_SHARDS x $DS4REF_CROSS_EXAMPLES cross-backend examples per numerics)"
  rm -f "$OUT/cross_examples.tsv"
  DS4REF_CROSS_LOG="$OUT/cross_examples.tsv" timeout ${BACKEND_TIMEOUT:-$(t 330)} $PYTEST -m gpu \
    tests/gpu/test_hip_backend.py -n "$WORKERS" 2>&1 | tee "$OUT/backend.log" || rc=1
  python3 - "$OUT/cross_examples.tsv" <<'PY' 2>&1 | tee -a "$OUT/backend.log"
import os, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
for numerics in sorted({r[0] for r in rows}):
    rs = [r[1:] for r in rows if r[0] == numerics]  # sequences, longest prompt, quantum (None: the whole pass), tokens
    quanta = sorted({int(r[2]) for r in rs if r[2] != "None"}) + (["whole pass"] if any(r[2] == "None" for r in rs) else [])
    print(f"cross-backend examples passed, {numerics}: {len(rs)} (sequences {sum(int(r[0]) for r in rs)}, "
          f"longest prompt {max(int(r[1]) for r in rs)}, quanta {quanta}, tokens compared {sum(int(r[3]) for r in rs)})")
PY
fi
if has draft; then
  stage "speculation on the device: MTP and DSpark drafts bitwise, speculative decoding against plain"
  timeout ${DRAFT_TIMEOUT:-$(t 300)} $PYTEST -m gpu tests/gpu/test_hip_mtp.py tests/gpu/test_hip_speculative.py \
    tests/gpu/test_hip_dspark.py -n 6 2>&1 | tee "$OUT/draft.log" || rc=1
fi
if has golden; then
  stage "golden files through the HIP backend"
  DS4REF_BACKEND=hip timeout $(t 150) $PYTEST -m golden tests/test_golden.py 2>&1 | tee "$OUT/golden.log" || rc=1
fi
if has serve; then
  stage "hip server with the openai client"
  timeout $(t 150) $PYTEST -m gpu tests/gpu/test_serve_hip.py 2>&1 | tee "$OUT/serve.log" || rc=1
fi
if has decode; then
  stage "decode benchmark (8-layer Flash-shaped bf16, 256 experts)"
  timeout ${DECODE_TIMEOUT:-$(t 150)} python3 benchmarks/decode_gpu.py --out "$OUT/perf_decode_gpu.md" \
    --json "$OUT/perf_decode_gpu.json" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" || rc=1
fi
if has prefill; then
  stage "prompt passes: throughput, TTFT, ITL while a 16k prompt runs (8-layer bf16, 256 experts)"
  timeout ${PREFILL_TIMEOUT:-$(t 240)} python3 benchmarks/prefill_gpu.py --out "$OUT/perf_prefill_gpu.md" \
    --json "$OUT/perf_prefill_gpu.json" ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill.log" || rc=1
fi
if has hf; then
  stage "transformers' eager DeepseekV4 on the 8-layer config, side by side"
  timeout ${HF_TIMEOUT:-$(t 200)} python3 benchmarks/hf_eager_gpu.py --lanes 1,4,8,16 --json "$OUT/hf_eager_gpu.json" 2>&1 \
    | tee "$OUT/hf.log" || rc=1
fi
if has full; then
  stage "decode benchmark (Flash, 43 layers, q2 policy)"
  timeout ${FULL_TIMEOUT:-$(t 240)} python3 benchmarks/decode_gpu.py --full --ctx 256,4096,32768 \
    --out "$OUT/perf_full_gpu.md" --json "$OUT/perf_full_gpu.json" ${FULL_ARGS:-} 2>&1 | tee "$OUT/full.log" || rc=1
fi
if has fullprefill; then
  stage "prompt passes on Flash (43 layers, q2 policy): TTFT of a 4k and a 32k prompt"
  timeout ${FULLPREFILL_TIMEOUT:-$(t 420)} python3 benchmarks/prefill_gpu.py --full --prompts 4096,32768 --itl-prompt 0 \
    --out "$OUT/perf_prefill_full_gpu.md" --json "$OUT/perf_prefill_full_gpu.json" ${FULLPREFILL_ARGS:-} 2>&1 \
    | tee "$OUT/prefill_full.log" || rc=1
fi
if has prefix; then
  # a next chat turn (+200 tokens) on a 16k and a 4k history, cache on and off: TTFT and equal bits.
  # Device time: about 2 prefills of each history per model (PREFIX_HISTORY=4096 for a cheap run).
  stage "prefix cache: TTFT of a next turn on the 8-layer model and on Flash (43 layers, q2 policy)"
  timeout ${PREFIX_TIMEOUT:-$(t 150)} python3 benchmarks/prefix_gpu.py --history ${PREFIX_HISTORY:-16384,4096} \
    --out "$OUT/perf_prefix_gpu.md" --json "$OUT/perf_prefix_gpu.json" 2>&1 | tee "$OUT/prefix.log" || rc=1
  timeout ${FULLPREFIX_TIMEOUT:-$(t 360)} python3 benchmarks/prefix_gpu.py --full --history ${PREFIX_HISTORY:-16384,4096} \
    --out "$OUT/perf_prefix_full_gpu.md" --json "$OUT/perf_prefix_full_gpu.json" 2>&1 | tee "$OUT/prefix_full.log" || rc=1
fi
if has profile; then
  stage "kernel times inside the captured pass (CUPTI; Flash, 43 layers, q2 policy)"
  timeout ${PROFILE_TIMEOUT:-$(t 180)} python3 benchmarks/graph_profile.py --full --lanes 1,16 --ctx 4096 --prompt 1024 \
    --top 40 --out "$OUT/graph_profile.md" 2>&1 | tee "$OUT/profile.log" || rc=1
  stage "the C = 1 pass by launch shape (kernel and grid)"
  timeout ${PROFILE_TIMEOUT:-$(t 180)} python3 benchmarks/graph_profile.py --full --lanes 1 --ctx 4096 --prompt 0 --by-op \
    --top 60 --out "$OUT/graph_profile_ops.md" 2>&1 | tee -a "$OUT/profile.log" || rc=1
fi
if has spec; then
  stage "speculative decoding against acceptance, oracle drafts (Flash, 43 layers, q2 policy; K = 3)"
  timeout ${SPEC_TIMEOUT:-$(t 300)} python3 -m ds4ref.cli.bench --speculative-tokens 3 --synthetic full --concurrency 1,4,16 \
    --draft oracle:0 --draft oracle:0.5 --draft oracle:0.7 --draft oracle:1 --draft mtp --no-auto-off 2>&1 \
    | tee "$OUT/spec.log" || rc=1
  stage "speculative decoding with a random DSpark draft of 0731's settings (Flash, 43 layers, q2 policy; K = 3)"
  timeout ${SPEC_TIMEOUT:-$(t 300)} python3 -m ds4ref.cli.bench --speculative-tokens 3 --synthetic full --concurrency 1,4,16 \
    --draft dspark --no-auto-off 2>&1 | tee -a "$OUT/spec.log" || rc=1
fi
if has launch; then
  # programmatic dependent launch, and with it the weight prefetch before each wait (ds4_hip.h):
  # the same decode benchmark off / on / on with DS4_PDL_PREFETCH=1, side by side in one run
  stage "decode with DS4REF_PDL off, on, and on with the weight prefetch (Flash, 43 layers, q2 policy)"
  for v in off:0: on:1: prefetch:1:DS4_PDL_PREFETCH=1; do
    IFS=: read -r name pdl defines <<< "$v"
    DS4REF_PDL=$pdl DS4REF_KERNEL_DEFINES=$defines timeout ${LAUNCH_TIMEOUT:-$(t 120)} python3 benchmarks/decode_gpu.py \
      --full --ctx 4096 --lanes 1,4,16 --out "$OUT/perf_launch_$name.md" 2>&1 | tee -a "$OUT/launch.log" || rc=1
  done
fi
stage "done rc=$rc"
# One report to send back: the machine, each stage's closing lines, and the benchmark tables
{ echo "# ds4ref gpu_check report (rc=$rc, $(date -u +%Y-%m-%dT%H:%MZ))"; echo; echo '```'; cat "$OUT/env.log"; echo '```'
  for log in build ops backend golden serve decode prefill full prefill_full; do
    [ -f "$OUT/$log.log" ] || continue
    echo; echo "## $log"; echo '```'; grep -E 'passed|failed|error|Error|compiled|runtime|FAILED|tok/s' "$OUT/$log.log" | tail -15; echo '```'
  done
  for table in "$OUT"/perf_*.md; do [ -f "$table" ] && { echo; cat "$table"; }; done; } > "$OUT/report.md"
echo "report: $OUT/report.md"
exit $rc
