#!/usr/bin/env bash
# KV transport bandwidth against ucx_perftest on the same transport, in the same run.
# Usage: scripts/bench-kv.sh [TLS]   (default tcp)
set -euo pipefail
tls=${1:-tcp}
export UCX_TLS=$tls UCX_NET_DEVICES=lo
port=$((20000 + RANDOM % 20000))
ucx_perftest -p "$port" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
# The server takes a moment to listen: retry the client until it connects (probing the port
# with another client would be taken as the test's peer).
perf=""
for _ in $(seq 50); do
  perf=$(ucx_perftest 127.0.0.1 -p "$port" -t tag_bw -s 4194304 -n 200 2>/dev/null | awk '/^Final:/{print $(NF-2)}') || true
  [ -n "$perf" ] && break
  sleep 0.2
done
wait $server 2>/dev/null || true
ours=$(cargo run -q --release -p tandem-kv --example kv_bandwidth -- --messages 200 --size-mib 4 2>/dev/null | grep -oE '[0-9.]+ MiB/s' | head -1 | cut -d' ' -f1)
echo "transport: UCX_TLS=$tls, 200 x 4 MiB"
echo "  ucx_perftest tag_bw : ${perf} MB/s"
echo "  tandem-kv           : ${ours} MiB/s"
python3 -c "print(f'  ratio               : {float(\"$ours\")*1.048576/float(\"$perf\"):.2f}')"
