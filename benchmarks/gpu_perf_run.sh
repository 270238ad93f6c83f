#!/usr/bin/env bash
# One device run for the decode-speed work (issue E): compile every kernel, the GPU op
# tests and the backend tests (exactness, batch invariance), then the op timings, the
# Flash-shaped decode benchmark and transformers' eager DeepseekV4 on the same shape.
# Everything lands under $OUT (the device tool brings it back).
#   run with carry [".whl"]:  bash benchmarks/gpu_perf_run.sh
#   STAGES: any of build,optest,backend,decode,ops,hf (default all)
set -u -o pipefail
source "$(dirname "$0")/gpu_env.sh"
STAGES=${STAGES:-build,optest,backend,decode,ops,hf}
export DS4REF_GPU_EXAMPLES=${DS4REF_GPU_EXAMPLES:-3}
rc=0
T0=$SECONDS
stage() { echo "== [$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/env.log"

if [[ $STAGES == *build* ]]; then
  stage build
  timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/build.log" || { echo "BUILD FAILED"; exit 1; }
import time
from ds4ref.hip.runtime import get_runtime, KERNEL_DIR
rt = get_runtime()
for f in sorted(KERNEL_DIR.glob("*.hip")):
    t = time.time(); rt.compile_file(f.name); print(f"compiled {f.name} in {time.time() - t:.1f} s")
PY
fi
if [[ $STAGES == *optest* ]]; then
  stage "op tests"
  timeout ${OPTEST_TIMEOUT:-170} python3 -m pytest -m gpu tests/gpu/test_ops_gpu.py -q -rfE --tb=short -x \
      -p no:cacheprovider 2>&1 | tee "$OUT/test_ops.log" || rc=1
fi
if [[ $STAGES == *backend* ]]; then
  stage "backend tests"
  timeout ${BACKEND_TIMEOUT:-150} python3 -m pytest -m gpu tests/gpu/test_hip_backend.py -q -rfE --tb=short \
      -p no:cacheprovider 2>&1 | tee "$OUT/test_backend.log" || rc=1
fi
if [[ $STAGES == *decode* ]]; then
  stage "decode benchmark"
  timeout ${DECODE_TIMEOUT:-120} python3 benchmarks/decode_gpu.py --out "$OUT/perf_decode_gpu.md" 2>&1 \
      | tee "$OUT/decode.log" || rc=1
fi
if [[ $STAGES == *ops* ]]; then
  stage "op benchmark"
  timeout ${OPS_TIMEOUT:-120} python3 benchmarks/ops_gpu.py --out "$OUT/perf_ops_gpu.md" 2>&1 | tee "$OUT/ops.log" || rc=1
fi
if [[ $STAGES == *hf* ]]; then
  stage "transformers eager"
  timeout ${HF_TIMEOUT:-100} python3 benchmarks/hf_eager_gpu.py 2>&1 | tee "$OUT/hf_eager.log" || rc=1
fi
stage "done rc=$rc"
exit $rc
