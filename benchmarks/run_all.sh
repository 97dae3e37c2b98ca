#!/usr/bin/env bash
# Re-runs the measurements of benchmarks/HISTORY.md (the issues before the native core); writes benchmarks/results/*.{txt,json,png}.
# Takes 5-15 minutes on the 2-core reference machine, depending on its load. Check `uptime` first: other load
# skews every figure (the load before and after each run is recorded in its .txt file).
set -u
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/bench_lib.sh
source benchmarks/bench_lib.sh
run ops2_gloo --op all --sizes 4,4K,256K,4M,64M --world-size 2 --vs gloo --check --iters 10 --warmup 3
run a2a2_gloo --op all_to_all,all_to_all_single --sizes 4,4K,256K,4M,64M --world-size 2 --vs gloo \
    --check --iters 10 --warmup 3
run ops2_raycol --op all_reduce,broadcast,reduce,all_gather,reduce_scatter --sizes 4,256K,64M \
    --world-size 2 --vs ray-collective --iters 10 --warmup 3
run ops4_gloo --op all_reduce,broadcast,all_gather,reduce_scatter,all_to_all --sizes 4,256K,4M,64M \
    --world-size 4 --vs gloo --check --iters 8 --warmup 2
run small2 --op all_reduce --sizes 4 --world-size 2 --iters 300 --warmup 30 --baselines
run small2_coordinator --op all_reduce --sizes 4 --world-size 2 --iters 300 --warmup 30 --baselines \
    --set transport=store
run store2_gloo --op all --sizes 4M,64M --world-size 2 --vs gloo --check --iters 10 --warmup 3 \
    --set stream=false
run store4_gloo --op all_reduce,broadcast --sizes 64M --world-size 4 --vs gloo --iters 8 --warmup 2 \
    --set stream=false
run nodes2 --op all_reduce,broadcast,all_gather --sizes 4M,64M --world-size 2 --nodes 2 \
    --iters 6 --warmup 2 --check --baselines
run curve_size --op all_reduce --sizes 4:64M:x4 --world-size 2 --vs gloo --iters 10 --warmup 3 \
    --plot "$out/curve_size.png"
run curve_world --op all_reduce --sizes 4 --world-size 2,4,8,16 --vs gloo --iters 50 --warmup 10 \
    --plot "$out/curve_world.png"
run memory --op all --sizes 64M --world-size 2 --iters 6 --warmup 2 --memory
run memory_store --op all --sizes 64M --world-size 2 --iters 6 --warmup 2 --memory --set stream=false
run memory_ray_default --op all_reduce,broadcast --sizes 64M --world-size 2 --iters 6 --warmup 2 \
    --memory --ray-free-period-ms 0 --set stream=false
run free_period_default --op all_reduce,broadcast,all_gather --sizes 4M,64M --world-size 2 \
    --vs gloo --iters 10 --warmup 3 --ray-free-period-ms 0 --set stream=false
{ echo "# load before: $(uptime)"; python benchmarks/cross_node_bound.py 2>/dev/null
  echo "# load after: $(uptime)"; } > "$out/cross_node_bound.txt"
cat "$out/cross_node_bound.txt"
