#!/usr/bin/env bash
# One device run for the HIP backend (issue E): carried wheels, the backend's GPU tests,
# the golden tests with DS4REF_BACKEND=hip, then the Flash-shaped decode benchmark.
# Logs and the benchmark table land under $OUT (the device tool brings them back).
#   run with carry [".whl"]:  bash benchmarks/gpu_backend_run.sh
#   STAGES=test,golden,bench (any subset); per-stage timeouts TEST_TIMEOUT, GOLDEN_TIMEOUT, BENCH_TIMEOUT
set -u -o pipefail
source "$(dirname "$0")/gpu_env.sh"
STAGES=${STAGES:-test,golden,bench}
export DS4REF_GPU_EXAMPLES=${DS4REF_GPU_EXAMPLES:-6}
rc=0

{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1
  python3 -c "import sys, numpy, gguf; print(sys.version); print('numpy', numpy.__version__)" 2>&1; } | tee "$OUT/env.log"

if [[ $STAGES == *test* ]]; then
  echo "== tests/gpu/test_hip_backend.py"
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu tests/gpu/test_hip_backend.py -q -s -rfE --tb=short \
      -p no:cacheprovider 2>&1 | tee "$OUT/hip_backend_test.log" || rc=1
fi
if [[ $STAGES == *golden* ]]; then
  echo "== DS4REF_BACKEND=hip pytest -m golden"
  DS4REF_BACKEND=hip timeout ${GOLDEN_TIMEOUT:-60} python3 -m pytest -m golden tests/test_golden.py -q -s -rfE \
      --tb=short -p no:cacheprovider 2>&1 | tee "$OUT/golden_hip.log" || rc=1
fi
if [[ $STAGES == *bench* ]]; then
  echo "== benchmarks/decode_gpu.py"
  timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/decode_gpu.py --out "$OUT/perf_decode_gpu.md" 2>&1 \
      | tee "$OUT/decode_bench.log" || rc=1
fi
echo "gpu_backend_run.sh done rc=$rc"
exit $rc
