#!/usr/bin/env bash
# KV transport bandwidth against ucx_perftest on the same transport, in the same run.
# Usage: scripts/bench-kv.sh [tcp|sm|landing|put]   (default tcp)
#   tcp, sm:  the transport's tagged messages (UCX_TLS=tcp or sm) vs ucx_perftest tag_bw.
#   landing:  the shared-memory landing path of two workers on one host (a copy into the
#             receiver's slot, then a completion record over UCX) vs ucx_perftest ucp_put_bw
#             over UCX_TLS=sm (one-sided puts into the peer's memory).
#   put:      the cross-host landing path over UCX_TLS=tcp (remote claim, one-sided put,
#             flush, completion record) vs ucx_perftest ucp_put_bw over tcp.
set -euo pipefail
mode=${1:-tcp}
case "$mode" in
  landing) perf_tls=sm; perf_test=ucp_put_bw; ours_tls=tcp; ours_args=(--landing --messages 400) ;;
  put) perf_tls=tcp; perf_test=ucp_put_bw; ours_tls=tcp; ours_args=(--put --messages 200) ;;
  *) perf_tls=$mode; perf_test=tag_bw; ours_tls=$mode; ours_args=(--messages 200) ;;
esac
export UCX_NET_DEVICES=lo
port=$((20000 + RANDOM % 20000))
UCX_TLS=$perf_tls,self ucx_perftest -p "$port" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
# The server takes a moment to listen: retry the client until it connects (probing the port
# with another client would be taken as the test's peer).
perf=""
for _ in $(seq 50); do
  perf=$(UCX_TLS=$perf_tls,self ucx_perftest 127.0.0.1 -p "$port" -t "$perf_test" -s 4194304 -n 200 2>/dev/null | awk '/^Final:/{print $(NF-2)}') || true
  [ -n "$perf" ] && break
  sleep 0.2
done
wait $server 2>/dev/null || true
ours=$(UCX_TLS=$ours_tls cargo run -q --release -p tandem-kv --example kv_bandwidth -- --size-mib 4 "${ours_args[@]}" 2>/dev/null | grep -oE '[0-9.]+ MiB/s' | head -1 | cut -d' ' -f1)
echo "mode: $mode, 4 MiB messages"
echo "  ucx_perftest $perf_test (UCX_TLS=$perf_tls): ${perf} MB/s"
echo "  tandem-kv ($mode)                : ${ours} MiB/s"
python3 -c "print(f'  ratio                            : {float(\"$ours\")*1.048576/float(\"$perf\"):.2f}')"
