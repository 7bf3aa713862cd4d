#!/usr/bin/env bash
# On the GPU machine: restart figures for the bundled model and a v2-lite-shaped
# checkpoint (31 GB), with and without the zygote, and memory with 1 and 4 workers.
set -u
export PYTHONUNBUFFERED=1
python3 -m preload.cli.main make-checkpoint --shape v2-lite --out /tmp/v2-lite 2>&1 | tail -1
python3 -m preload.cli.main bench restart --device cuda:0 --small bundled/tiny-v3 --large /tmp/v2-lite \
  --restarts 10 --cold-repeat 1 --memory-workers 4 --json "$OUT/restart-h200.json" 2>&1 | tee "$OUT/restart-h200.log" | grep -v "^\.\.\. " | tail -60
