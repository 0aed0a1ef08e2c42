#!/usr/bin/env bash
# Regenerates the README's picture, docs/images/serve-sweep-smollm2.png: the default model
# served with the default config on this machine, `jaxserve bench serve`'s random workload
# (100-300 prompt tokens, 64 out) swept over concurrency 1, 2, 4, 8, 16.
#
#   scripts/plot_readme.sh            # with .venv/bin/jaxserve (pip install -e ".[plot]")
set -euo pipefail
cd "$(dirname "$0")/.."
jaxserve=${JAXSERVE:-.venv/bin/jaxserve}
port=${PORT:-50071}
log=$(mktemp)
"$jaxserve" run --config configs/smollm2-135m.yaml --quiet --set server.port="$port" \
    --set server.http_port=null --set server.metrics_port=null >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -f "$log"' EXIT
until grep -q "jaxserve: serving" "$log"; do
    kill -0 "$server" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 1
done
grep "jaxserve: cpu" "$log" || true
"$jaxserve" bench serve --server "127.0.0.1:$port" --workload random --concurrency 1,2,4,8,16 \
    --num-requests 32 --input-len 100:300 --output-len 64:64 --quiet \
    --json docs/images/serve-sweep-smollm2.json --plot docs/images/serve-sweep-smollm2.png
