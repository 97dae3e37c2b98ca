#!/usr/bin/env bash
# Re-runs the direct-connection measurements of benchmarks/HISTORY.md ("Across nodes and
# point to point"): two Ray nodes on this machine (ray.cluster_utils.Cluster, sockets on
# loopback) and point-to-point on one node, each against gloo in the same run. 2-3 minutes
# on the 2-core reference machine; check `uptime` first.
set -u
cd "$(dirname "$0")/.."
export RAYCOLL_SOCKET_IFNAME=lo
# shellcheck source=benchmarks/bench_lib.sh
source benchmarks/bench_lib.sh
# one node, point to point (a round trip between the two ranks)
run p2p1_gloo --op send_recv --sizes 4,256K,4M,64M --world-size 2 --vs gloo --check \
    --iters 100 --warmup 20
# two nodes, one rank on each: small sizes with many iterations, then every size
run nodes2_small --op all_reduce,broadcast,send_recv --sizes 4,256K --world-size 2 --nodes 2 \
    --vs gloo --check --iters 200 --warmup 50
run nodes2_tcp --op all_reduce,broadcast,send_recv --sizes 4,256K,4M,64M --world-size 2 \
    --nodes 2 --vs gloo --check --iters 20 --warmup 5
# two nodes, two ranks on each
run nodes2_4ranks --op all_reduce,broadcast --sizes 4,256K,64M --world-size 4 --nodes 2 \
    --vs gloo --check --iters 10 --warmup 3
