#!/usr/bin/env bash
# One device run for the 16-lane matvec / routed-expert work: every `gpu` test (exactness:
# v3 == v1 bitwise, lane alone == among 16, the hip server), then the op timings of the
# matvecs and routed experts at 1 and 16 lanes and the decode pass at C = 1, 4, 8, 16
# (context 256); a short table last. Run with carry [".whlserve"] (the server tests need
# fastapi/openai/gguf):  bash benchmarks/gpu_lanes_run.sh
set -u -o pipefail
source "$(dirname "$0")/gpu_env.sh"
export DS4REF_GPU_EXAMPLES=${DS4REF_GPU_EXAMPLES:-4}
rc=0
T0=$SECONDS
stage() { echo "== [$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | tee "$OUT/env.log"
stage "all gpu tests"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu tests/gpu -q -rfE --tb=short -x -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -n 12 || rc=1
stage "op benchmark (matvecs, experts)"
DS4REF_BENCH_SMALL=0 DS4REF_BENCH_VERSIONS=${DS4REF_BENCH_VERSIONS:-"v3,v3 r1,v3 r2"} \
  timeout ${OPS_TIMEOUT:-80} python3 benchmarks/ops_gpu.py --out "$OUT/perf_ops_gpu.md" > "$OUT/ops.log" 2>&1 || rc=1
stage "decode benchmark"
timeout ${DECODE_TIMEOUT:-70} python3 benchmarks/decode_gpu.py --ctx 256 --lanes 1,4,8,16 \
  --out "$OUT/perf_decode_gpu.md" > "$OUT/decode.log" 2>&1 || rc=1
stage "done rc=$rc"
echo "== kernel profile (C = 16)"; grep -A14 "C = 16, context" "$OUT/perf_decode_gpu.md" | head -n 16
echo "== ops (µs)"; grep -E "^\| (matvec|attn_q_a|attn_q_b|attn_output_b|shexp|output|router|experts)" "$OUT/perf_ops_gpu.md" \
  | awk -F'|' '{printf "%-44s L=%-3s %9s us %6s\n", $2, $3, $4, $7}'
echo "== decode"; grep -E "^\| 256 \|" "$OUT/perf_decode_gpu.md"
tail -n 2 "$OUT/gpu_tests.log"
exit $rc
