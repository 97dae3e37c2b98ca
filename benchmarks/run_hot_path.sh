#!/usr/bin/env bash
# The small-collective hot path, A/B in one session: this checkout against an earlier commit
# (default: the one before the hot-path work), interleaved run by run so that the machine's
# drift hits both alike. Usage: bash benchmarks/run_hot_path.sh [BASE_COMMIT] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
base="${1:-66a7e80}"
rounds="${2:-2}"
old="$(mktemp -d)"
trap 'git worktree remove --force "$old" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$old" "$base"
args=(--op ${OPS:-all_reduce,broadcast,all_gather,reduce_scatter} --sizes ${SIZES:-4,4K,64K,1M}
      --iters 200 --warmup 50 --no-progress)
for r in $(seq "$rounds"); do
  echo "# round $r: HEAD ($(git rev-parse --short HEAD))"
  python -m raycoll.bench "${args[@]}" | grep -v '^#'
  echo "# round $r: base ($base)"
  (cd "$old" && PYTHONPATH="$old" python -m raycoll.bench "${args[@]}" | grep -v '^#')
done
