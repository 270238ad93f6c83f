#!/usr/bin/env bash
# Download benchmarks/device_wheels.txt into .whl/ for the GPU machine (Python 3.12, x86-64).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -v '^#' benchmarks/device_wheels.txt | while read -r spec; do
  [[ -n $spec ]] || continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
ls .whl | wc -l
