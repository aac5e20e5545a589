#!/usr/bin/env bash
# docs/mlflow.png: a short real session (this repo's train.py, --profile tiny, 5 s budget, 8 experiments) mirrored
# with --tracker mlflow to a local MLflow server, then the MLflow UI comparing the session's child runs, shot with
# headless Chromium. A few minutes of CPU.
#
# Needs: pip install -e ".[mlflow]" -c constraints.txt; chromium (Debian: apt-get install -y chromium).
# Usage: docs/mlflow_screenshot.sh [EXPERIMENTS]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
EXPERIMENTS="${1:-8}"
WORK="$(mktemp -d)"
# 127.0.0.2, not localhost: for a server on localhost the UI opens its assistant panel over the page
HOST=127.0.0.2
PORT="$(python -c "import socket; s = socket.socket(); s.bind(('$HOST', 0)); print(s.getsockname()[1])")"
URL="http://$HOST:$PORT"
SERVER=""

cleanup() {
    if [ -n "$SERVER" ]; then kill -9 -- "-$SERVER" 2>/dev/null || true; fi  # the server and its job runners
    rm -rf "$WORK"
}
trap cleanup EXIT

# the session works on a clone: this checkout and its .autoloop/ stay as they are
git clone -q "$ROOT" "$WORK/repo"

setsid mlflow server --backend-store-uri "sqlite:///$WORK/mlflow.db" --artifacts-destination "$WORK/artifacts" \
    --host "$HOST" --port "$PORT" --workers 1 --allowed-hosts "$HOST:$PORT" --cors-allowed-origins "$URL" \
    > "$WORK/server.log" 2>&1 < /dev/null &
SERVER=$!  # setsid without a fork here (a script's job is no group leader): its pid is the group's id
disown "$SERVER"  # no "Killed" note from bash when cleanup ends it
for _ in $(seq 240); do
    curl -sf "$URL/health" > /dev/null && break
    sleep 0.5
done
curl -sf "$URL/health" > /dev/null || { tail -20 "$WORK/server.log"; echo "the MLflow server did not start"; exit 1; }

(cd "$WORK/repo" && MLFLOW_TRACKING_URI="$URL" MLFLOW_EXPERIMENT_NAME=autoloop-demo \
    autoloop run --tag demo --profile tiny --budget 5 --max-experiments "$EXPERIMENTS" --baseline-repeats 1 \
    --tracker mlflow)

# the compare page of the session's child runs that have a val_bpb, in experiment order
PAGE="$(MLFLOW_TRACKING_URI="$URL" python - <<'EOF'
import json
from urllib.parse import quote

from mlflow import MlflowClient

client = MlflowClient()
experiment = client.get_experiment_by_name("autoloop-demo").experiment_id
parent = client.search_runs([experiment], "attributes.run_name = 'demo'")[0].info.run_id
children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
runs = [r.info.run_id for r in sorted(children, key=lambda r: int(r.data.tags["n"])) if "val_bpb" in r.data.metrics]
print(f"#/compare-runs?runs={quote(json.dumps(runs))}&experiments={quote(json.dumps([experiment]))}")
EOF
)"

# --no-sandbox: Chromium's own sandbox does not run as root (a container)
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,1000 \
    --virtual-time-budget=15000 --screenshot="$ROOT/docs/mlflow.png" "$URL/$PAGE" 2> /dev/null
echo "wrote $ROOT/docs/mlflow.png"
