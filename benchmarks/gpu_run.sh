#!/usr/bin/env bash
# The one script a device run executes: compile every kernel, run the GPU op tests,
# then time every op at Flash dims. Logs and the table land under $OUT (the device
# tool brings them back) and the table also in docs/perf_ops_gpu.md.
#   bash benchmarks/gpu_run.sh            # everything
#   STAGES=test bash benchmarks/gpu_run.sh   # only the tests (STAGES: any of build,test,bench)
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ds4ref_gpu_out}
STAGES=${STAGES:-build,test,bench}
mkdir -p "$OUT" docs
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export DS4REF_GPU_EXAMPLES=${DS4REF_GPU_EXAMPLES:-12}   # hypothesis examples per GPU test
rc=0

# The GPU path needs only config, tensors, backend, paging/layout, reference/ops and hip.
# If the package's __init__ cannot import here (a half-finished edit elsewhere, a missing
# optional dependency such as gguf), run from a shim package holding just those modules.
if ! python3 -c "import ds4ref.hip.ops, ds4ref.reference.ops" 2>"$OUT/import.err"; then
  echo "import ds4ref failed ($(tail -1 "$OUT/import.err")); using a minimal shim package"
  shim=/tmp/ds4ref_shim/ds4ref
  rm -rf /tmp/ds4ref_shim && mkdir -p "$shim/reference" "$shim/paging"
  touch "$shim/__init__.py" "$shim/reference/__init__.py" "$shim/paging/__init__.py"
  for f in config.py tensors.py backend.py; do ln -s "$PWD/ds4ref/$f" "$shim/$f"; done
  ln -s "$PWD/ds4ref/hip" "$shim/hip"
  ln -s "$PWD/ds4ref/reference/ops.py" "$shim/reference/ops.py"
  ln -s "$PWD/ds4ref/paging/layout.py" "$shim/paging/layout.py"
  mkdir -p /tmp/ds4ref_shim/tests /tmp/ds4ref_shim/docs
  ln -s "$PWD/tests/gpu" /tmp/ds4ref_shim/tests/gpu
  ln -s "$PWD/benchmarks" /tmp/ds4ref_shim/benchmarks
  REPO=$PWD
  cd /tmp/ds4ref_shim   # python -m puts the cwd first on sys.path: the shim wins
  echo "DS4REF_SHIM=1" >> "$OUT/env.log"
fi

# read-only queries of the card (never change its settings)
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
  python3 -c "import sys, numpy; print(sys.version); print('numpy', numpy.__version__)"
  python3 -c "import cuda.bindings as c; print('cuda-bindings', c.__version__)" 2>&1; } | tee "$OUT/env.log"

if [[ $STAGES == *build* ]]; then
  echo "== build: compile every kernel file"
  timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/build.log" || rc=1
import time, pathlib
from ds4ref.hip.runtime import get_runtime, KERNEL_DIR
rt = get_runtime()
print("runtime", rt.kind, rt.info)
for f in sorted(KERNEL_DIR.glob("*.hip")):
    t = time.time()
    rt.compile_file(f.name)
    print(f"compiled {f.name} in {time.time() - t:.2f} s")
PY
fi

if [[ $STAGES == *test* ]]; then
  echo "== test: pytest -m gpu tests/gpu"
  DS4REF_GPU_ERRLOG="$OUT/max_errors.tsv" timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/gpu \
      -q -rfE --tb=short -p no:cacheprovider 2>&1 | tee "$OUT/test.log" || rc=1
  [[ -f "$OUT/max_errors.tsv" ]] && { echo "largest norm-wise error per test (v2):"; cat "$OUT/max_errors.tsv"; }
  if [[ ${TEST_V1:-1} == 1 ]]; then
    echo "== test: the v1 (fallback) kernels"
    DS4REF_KERNELS=v1 timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/gpu -q -rfE --tb=short \
        -p no:cacheprovider 2>&1 | tee "$OUT/test_v1.log" || rc=1
  fi
fi

if [[ $STAGES == *bench* ]]; then
  echo "== bench: benchmarks/ops_gpu.py"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/ops_gpu.py --out "$OUT/perf_ops_gpu.md" \
      2>&1 | tee "$OUT/bench.log" || rc=1
  [[ -f "$OUT/perf_ops_gpu.md" ]] && cp "$OUT/perf_ops_gpu.md" "${REPO:-$PWD}/docs/perf_ops_gpu.md"
fi
echo "gpu_run.sh done rc=$rc"
exit $rc
