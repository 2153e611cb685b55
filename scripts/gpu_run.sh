#!/usr/bin/env bash
# Every GPU check in one go, on a CUDA host: the CUDA tests, then benchmarks/gpu_report.py
# (GPU.md and GPU.json). A bare GPU machine with torch but without this project's other
# packages gets them from wheels in .whl/ (see README "GPU"): pyzmq, structlog, nixl.
#   bash scripts/gpu_run.sh [gpu_report.py args]      results in $OUT (default benchmarks/results)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
t0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/th-site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/th-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import tensorhub.transports" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
export PYTHONUNBUFFERED=1
echo "setup: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The CUDA tests (they skip on a host without CUDA): packs, checksums, staging, conversion, deltas,
# the bucket and every built-in transport's conformance on GPU memory.
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_reshard_cuda.py \
  "tests/test_deltas.py::test_cuda_tensors_take_a_cpu_delta" "tests/test_bucket.py::test_cuda_tensors_are_written_and_restored_in_place" \
  tests/test_conformance.py -k "not broken" 2>&1 | tee "$out/gpu-tests.log" | tail -15
echo "tests: $(( $(date +%s) - t0 )) s"
python3 benchmarks/gpu_report.py --out "$out" "$@" 2>&1 | tee "$out/gpu-report.log" | grep -v "NIXL INFO"
echo "total: $(( $(date +%s) - t0 )) s"
