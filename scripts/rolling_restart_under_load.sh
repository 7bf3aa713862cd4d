#!/usr/bin/env bash
# Rolling restart under steady load: bench serve alone, then bench serve with `preload restart` in the middle.
set -u
cd "$(dirname "$0")/.."
P=.venv/bin/preload
S=/tmp/bump-state; rm -rf $S
$P start --state-dir $S --workers 2 --port 18071 --health-port 18072 --dtype float32 || exit 1
args="--url http://127.0.0.1:18071 --requests 48 --concurrency 4 --prompt-len 64:128 --output-len 32:64"
$P bench serve $args --json /tmp/bump-steady.json 2>/dev/null | grep -E "completed|throughput|time to first|inter-token|request latency"
( sleep 4; $P restart --state-dir $S; $P restart --state-dir $S ) &
$P bench serve $args --json /tmp/bump-restart.json 2>/dev/null | grep -E "completed|throughput|time to first|inter-token|request latency"
wait
$P status --state-dir $S | tail -2
$P stop --state-dir $S
