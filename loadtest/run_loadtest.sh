#!/usr/bin/env bash
# `make loadtest` (docs/loadtest.md): a bounded, headless Locust run against a running OpenAI-compatible server, then
# its report (loadtest.loadtest_report) → reports/loadtest.{md,json}, reports/loadtest_*.png; Locust's CSV and HTML
# and the per-request records in $OUT. Settings: the LOADTEST_* variables below, OPENAI_API_KEY if the server needs
# a key. Exit status: Locust's (1 if any request failed).
set -euo pipefail

VENV=${VENV:-.venv}
HOST=${LOADTEST_HOST:-http://127.0.0.1:8000}
USERS=${LOADTEST_USERS:-8}
SPAWN_RATE=${LOADTEST_SPAWN_RATE:-2}
RUN_TIME=${LOADTEST_TIME:-60s}
WORKLOAD=${LOADTEST_WORKLOAD:-skewed}
API=${LOADTEST_API:-mixed}
EXTRA=${LOADTEST_ARGS:-}
OUT=${LOADTEST_OUT:-reports/loadtest}
STOP_TIMEOUT=${LOADTEST_STOP_TIMEOUT:-120}  # s: let requests in flight at the end finish (counted)

base=${HOST%/}
case "$base" in */v1) models="$base/models" ;; *://*/*) models="$base/models" ;; *) models="$base/v1/models" ;; esac
auth=()
[ -n "${OPENAI_API_KEY:-}" ] && auth=(-H "Authorization: Bearer $OPENAI_API_KEY")
if ! curl -sf --max-time 10 "${auth[@]}" "$models" >/dev/null; then
  echo "[loadtest] no OpenAI-compatible server answers $models: start one first (\`make serve\` in another terminal, ready when it" \
       "logs 'OpenAI-compatible API ready'), or point LOADTEST_HOST at another server (with OPENAI_API_KEY if it needs a key)." >&2
  exit 2
fi

mkdir -p "$OUT"
rm -f "$OUT"/locust_*.csv "$OUT"/records.jsonl*
settings="$HOST: users=$USERS spawn_rate=$SPAWN_RATE run_time=$RUN_TIME workload=$WORKLOAD api=$API${EXTRA:+ $EXTRA}"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "[loadtest] $settings (+ up to ${STOP_TIMEOUT}s for requests in flight at the end)"
status=0
# shellcheck disable=SC2086  # EXTRA is a list of options
"$VENV/bin/locust" -f loadtest/locustfile.py --host "$HOST" --headless --only-summary \
  -u "$USERS" -r "$SPAWN_RATE" -t "$RUN_TIME" --stop-timeout "$STOP_TIMEOUT" \
  --workload "$WORKLOAD" --api "$API" --records "$OUT/records.jsonl" \
  --csv "$OUT/locust" --csv-full-history --html "$OUT/locust.html" $EXTRA || status=$?
"$VENV/bin/python" -m loadtest.loadtest_report --records "$OUT/records.jsonl" --out-dir reports \
  --title "$WORKLOAD workload against $HOST" --settings "$settings" --load-before "$load_before" \
  --command "make loadtest LOADTEST_USERS=$USERS LOADTEST_TIME=$RUN_TIME LOADTEST_WORKLOAD=$WORKLOAD LOADTEST_API=$API${EXTRA:+ LOADTEST_ARGS='$EXTRA'}"
echo "[loadtest] Locust exit status $status; its report: $OUT/locust.html; CSV: $OUT/locust_*.csv"
exit "$status"
