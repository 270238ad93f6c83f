#!/usr/bin/env bash
# Nsight Compute over the op-case table's perf mode: stall reasons, memory throughput and
# occupancy of chosen kernels at chosen lane counts (the H200's Firecracker image has ncu).
# Run on the GPU machine after gpu_check.sh's wheel install (PYTHONPATH set):
#   NCU_CASES="qrouted_experts:1:ds4_qexperts_iq2 qmatvec:16:ds4_qmatvec_q8" bash benchmarks/ncu_ops.sh
# Each case is ops:lanes:kernel-regex; the first NCU_COUNT (2) matching launches are profiled;
# NCU_SECTIONS replaces the sections.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ds4ref_gpu_out}
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
SECTIONS=${NCU_SECTIONS:-"--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats"}
for c in ${NCU_CASES:-}; do
  IFS=: read -r ops lanes rx <<< "$c"
  echo "=== ncu: ops=$ops lanes=$lanes kernels=$rx"
  timeout ${NCU_TIMEOUT:-150} "$NCU" --clock-control none -k "regex:$rx" -c ${NCU_COUNT:-2} $SECTIONS \
    python3 benchmarks/ops_gpu.py --lanes "$lanes" --ops "$ops" --out /tmp/ncu_ops_table.md 2>&1 \
    | grep -v "^==PROF==\|^| \|^|--\|^wrote"
done
