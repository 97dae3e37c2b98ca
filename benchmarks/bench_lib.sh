# Sourced by the benchmarks/run_*.sh scripts: `run NAME ARGS...` runs raycoll-bench once,
# its table (with the load before and after) to $out/NAME.txt and its rows to $out/NAME.json.
out=benchmarks/results
mkdir -p "$out"
run() {
  local name=$1; shift
  { echo "# load before: $(uptime)"; echo "# command: raycoll-bench $*"
    python -m raycoll.bench --no-progress --json "$out/$name.json" "$@" 2>/dev/null
    echo "# load after: $(uptime)"; } > "$out/$name.txt"
  cat "$out/$name.txt"
}
