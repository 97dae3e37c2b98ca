#!/usr/bin/env bash
# The one prepared GPU check for raycoll (see ../shared/gpu/README.md, beside this repository).
#
# Run from the repository root on the GPU machine (one GPU, Python 3.12 with cupy and NCCL,
# no Ray, no network), with Ray's wheels built beforehand on a networked machine by
# ../shared/gpu/pack-ray.sh (it writes .device/wheels/, which must travel along):
#
#     OUT=/some/dir benchmarks/gpu_check.sh      # OUT defaults to benchmarks/out
#
# (with the session's device tool: command "benchmarks/gpu_check.sh", carry [".device"],
# timeout_s 600; the tool sets $OUT and brings its files back.)
#
# It installs the wheels into /tmp/site, prints the environment, runs the GPU tests
# (tests/test_gpu.py, marked gpu: one-rank NCCL, the timeout abort, cuda:objstore with 2 and 4
# actors sharing the GPU), then measures a 256 MiB all_reduce over cuda:objstore (W=2, 4) and
# NCCL's one-rank figure, and the host<->device copy rates. Everything goes to
# $OUT/gpu_check.log (and $OUT/gpu_bandwidth.json); copy the log to benchmarks/ afterwards.
# Each part has its own time limit; a failing part is logged and the next one still runs.
# The exit status is non-zero when any part failed. The parts are capped at 60+90+270+150 s,
# under the 10-minute limit of one device command; expect about 4 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
status=0
part() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

part "environment"
date -u
git log --oneline -1 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 || true
python3 -V

part "install Ray from .device/wheels"
if ls .device/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/wheels/*.whl \
    || { echo "pip install of the Ray wheels FAILED"; status=1; }
else
  echo "no .device/wheels: build them on a networked machine with ../shared/gpu/pack-ray.sh"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0

part "versions"
timeout 60 python3 - <<'PY' || status=1
import importlib.util
import cupy
from cupy.cuda import nccl
print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "| NCCL", nccl.get_version() if nccl.available else "unavailable",
      "| GPUs", cupy.cuda.runtime.getDeviceCount())
for name in ("torch", "ray", "pytest", "pytest_timeout", "numpy"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(name, "not installed")
        continue
    mod = importlib.import_module(name)
    extra = f" cuda={mod.cuda.is_available()}" if name == "torch" else ""
    print(name, getattr(mod, "__version__", "?") + extra)
import raycoll
from raycoll.backends._cuda import nccl_unavailable_reason
print("raycoll", raycoll.__version__, "| is_nccl_available", raycoll.is_nccl_available(),
      "|", nccl_unavailable_reason() or "NCCL usable")
PY

part "ray.init smoke"
timeout 90 python3 -c "import ray; ray.init(include_dashboard=False); print(ray.cluster_resources()); ray.shutdown()" \
  || { echo "ray.init FAILED: the Ray-free NCCL tests below still run"; status=1; }

part "pytest -m gpu tests/test_gpu.py"
timeout 270 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rA --durations=10 \
  || { echo "GPU tests FAILED (rc=$?)"; status=1; }

part "bandwidth: 256 MiB all_reduce"
timeout 150 python3 benchmarks/gpu_bandwidth.py --mib 256 --iters 5 --world-sizes 2 4 \
  --json "$OUT/gpu_bandwidth.json" || { echo "bandwidth FAILED (rc=$?)"; status=1; }

part "done: status $status"
exit $status
