# Sourced by the benchmarks/gpu_*.sh device scripts: the environment one device run needs.
# The device image lacks gguf (and the server's packages); carry them as wheels in .whlserve
# (or .whl) with the run's `carry`, and they are installed into /tmp/site here.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/ds4ref_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 DS4REF_GPU_RUNTIME=${DS4REF_GPU_RUNTIME:-cuda}
export PYTHONPATH=$PWD
for dir in .whlserve .whl; do
  if ls "$dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$dir"/*.whl || { echo "wheel install from $dir failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
    break
  fi
done
