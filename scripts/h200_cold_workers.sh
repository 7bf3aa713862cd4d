#!/usr/bin/env bash
# On the GPU machine: `preload start --workers 1` to exit 0 (every worker ready) on the
# v2-lite-shaped checkpoint, against reading its files; the zygote imports while the daemon loads.
set -u
P="python3 -m preload.cli.main"
$P make-checkpoint --shape v2-lite --out /tmp/v2-lite 2>&1 | tail -1
SECONDS=0; cat /tmp/v2-lite/*.safetensors > /dev/null; echo "read the files: ${SECONDS} s"
for spares in 0 0 1; do
  SECONDS=0
  $P start --model /tmp/v2-lite --device cuda:0 --state-dir /tmp/cw --health-port 0 --workers 1 --spare-workers $spares --port 18801 | tail -1
  echo "spares $spares: start to ready ${SECONDS} s (whole seconds; the daemon's log has ms)"
  grep -h "loading\|worker 0 started\|worker 0 ready\|ready in" /tmp/cw/daemon.log | cut -c12-23,24-90
  $P stop --state-dir /tmp/cw | tail -1; rm -f /tmp/cw/daemon.log
done
