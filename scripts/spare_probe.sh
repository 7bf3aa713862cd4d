#!/usr/bin/env bash
# On the GPU machine: three SIGKILLs of a worker with a warm spare beside it; prints the
# spare's log lines (slot given, KV cache, ready) and the daemon's, with ms timestamps.
set -u
P="python3 -m preload.cli.main"
model=${1:-bundled/tiny-v3}
$P start --device cuda:0 --model $model --state-dir /tmp/sp --health-port 0 --workers 1 --spare-workers 1 --port 18800 2>&1 | tail -1
for i in 1 2 3; do
  for t in $(seq 100); do python3 -c "import json,sys;s=json.load(sys.stdin);sys.exit(0 if s['spares'] and s['spares'][0]['state']=='standby' else 1)" < <($P status --state-dir /tmp/sp --json) && break; sleep 0.1; done
  pid=$($P status --state-dir /tmp/sp --json | python3 -c "import json,sys;print(json.load(sys.stdin)['workers'][0]['pid'])")
  kill -9 $pid; sleep 2
done
grep -h "serving slot\|KV cache\|ready in" /tmp/sp/worker-0.log | tail -9
grep -h "takes slot\|worker 0 ready\|WARNING" /tmp/sp/daemon.log | tail -9
$P stop --state-dir /tmp/sp | tail -1
