#!/usr/bin/env bash
# The full local stack for users who want it: a Prefect server (UI on :4200), an MLflow
# tracking server (UI on :5000, SQLite + local artifacts) and SeaweedFS as S3 (:8333).
# Everything binds to 127.0.0.1 and lives under $ASYNCRL_STACK_DIR (default .stack/).
#   infra/local-stack.sh start | stop | status
set -euo pipefail
cd "$(dirname "$0")/.."
STACK_DIR=${ASYNCRL_STACK_DIR:-.stack}
VENV_BIN=${VENV_BIN:-.venv/bin}
mkdir -p "$STACK_DIR"/{logs,seaweedfs,mlflow}
export PREFECT_SERVER_ANALYTICS_ENABLED=false
# The server's database lives with the stack, not in the shared ~/.prefect.
case "$STACK_DIR" in /*) ;; *) STACK_DIR="$PWD/$STACK_DIR" ;; esac
export PREFECT_HOME=${PREFECT_HOME:-$STACK_DIR/prefect}
mkdir -p "$PREFECT_HOME"

start_one() {  # name, command...
  local name=$1; shift
  if [ -f "$STACK_DIR/$name.pid" ] && kill -0 "$(cat "$STACK_DIR/$name.pid")" 2>/dev/null; then
    echo "$name already running (pid $(cat "$STACK_DIR/$name.pid"))"; return
  fi
  setsid "$@" >"$STACK_DIR/logs/$name.log" 2>&1 &
  echo $! >"$STACK_DIR/$name.pid"
  echo "$name started (pid $!, log $STACK_DIR/logs/$name.log)"
}

case "${1:-start}" in
  start)
    start_one prefect "$VENV_BIN/prefect" server start --host 127.0.0.1 --port 4200
    start_one mlflow "$VENV_BIN/mlflow" server --host 127.0.0.1 --port 5000 \
      --backend-store-uri "sqlite:///$STACK_DIR/mlflow/mlflow.db" --artifacts-destination "$STACK_DIR/mlflow/artifacts"
    : "${AWS_ACCESS_KEY_ID:?set AWS_ACCESS_KEY_ID for the SeaweedFS S3 endpoint}"
    : "${AWS_SECRET_ACCESS_KEY:?set AWS_SECRET_ACCESS_KEY for the SeaweedFS S3 endpoint}"
    start_one seaweedfs "$VENV_BIN/weed" mini -dir="$STACK_DIR/seaweedfs" -ip=127.0.0.1 -ip.bind=127.0.0.1 -admin.ui=false
    cat <<EOT
Prefect UI      http://127.0.0.1:4200   (export PREFECT_API_URL=http://127.0.0.1:4200/api)
MLflow UI       http://127.0.0.1:5000   (tracking.mlflow_uri: http://127.0.0.1:5000)
S3 (SeaweedFS)  http://127.0.0.1:8333   (storage.options.endpoint_url)
Then: prefect work-pool create asyncrl-process --type process; ASYNCRL_HOME=\$PWD prefect deploy --all;
      prefect worker start --pool asyncrl-process
EOT
    ;;
  stop)
    for name in seaweedfs mlflow prefect; do
      if [ -f "$STACK_DIR/$name.pid" ]; then
        kill -- -"$(cat "$STACK_DIR/$name.pid")" 2>/dev/null || true
        rm -f "$STACK_DIR/$name.pid"; echo "$name stopped"
      fi
    done
    ;;
  status)
    for name in prefect mlflow seaweedfs; do
      if [ -f "$STACK_DIR/$name.pid" ] && kill -0 "$(cat "$STACK_DIR/$name.pid")" 2>/dev/null; then
        echo "$name: running (pid $(cat "$STACK_DIR/$name.pid"))"; else echo "$name: stopped"; fi
    done
    ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
