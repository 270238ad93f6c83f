#!/usr/bin/env bash
# One device run that checks the whole GPU path as a user meets it:
#   every `gpu` test (op twins, HipBackend, the hip server with the openai client),
#   the golden files through the HIP backend, and a ds4ref.bench table from a hip server.
# Run on the device with carry [".whlserve"] (wheels the device image lacks: gguf, fastapi,
# uvicorn, pydantic, openai and their needs; see docs/kernels.md for how they were fetched).
set -u -o pipefail
source "$(dirname "$0")/gpu_env.sh"
export DS4REF_GPU_EXAMPLES=${DS4REF_GPU_EXAMPLES:-8} DS4REF_GPU_ERRLOG=$OUT/max_errors.tsv
rc=0
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 --version; } 2>&1 | tee "$OUT/env.log"

echo "== all gpu tests"
timeout 300 python3 -m pytest -m gpu tests/gpu -q -rfE --tb=short -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -15 || rc=1

echo "== golden files through the HIP backend"
DS4REF_BACKEND=hip timeout 120 python3 -m pytest -m golden tests/test_golden.py -q -rs -s -p no:cacheprovider 2>&1 \
  | tee "$OUT/golden_hip.log" | tail -8 || rc=1

echo "== ds4ref.bench against a hip server (embedded tiny model)"
python3 -m ds4ref.serve --backend hip --port 8077 --max-concurrency 16 > "$OUT/serve_hip.log" 2>&1 &
pid=$!
python3 - <<'PY'
import time, httpx
for _ in range(240):
    try:
        if httpx.get("http://127.0.0.1:8077/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
PY
head -1 "$OUT/serve_hip.log"
timeout 150 python3 -m ds4ref.bench --url http://127.0.0.1:8077 --concurrency 1,4,8,16 --max-tokens 256 \
  2>/dev/null | tee "$OUT/bench_hip.txt" || rc=1
kill -TERM $pid; wait $pid
echo "server exit status after SIGTERM: $?"
exit $rc
