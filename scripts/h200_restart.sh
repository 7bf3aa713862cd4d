#!/usr/bin/env bash
# On the GPU machine: restart figures for the bundled model and a v2-lite-shaped
# checkpoint (31 GB): a warm spare taking over (sigkill-spare), a zygote fork (sigkill),
# `preload restart` (graceful) and no zygote; host and device memory with 1 and 4 workers.
# Four daemons per model; about 7 minutes in all on an H200 (the checkpoint's writing included).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -m preload.cli.main make-checkpoint --shape v2-lite --out /tmp/v2-lite 2>&1 | tail -1
echo "checkpoint ready after ${SECONDS} s"
python3 -m preload.cli.main bench restart --device cuda:0 --small bundled/tiny-v3 --large /tmp/v2-lite \
  --restarts 10 --cold-repeat 1 --memory-workers 4 --json "$OUT/restart-h200.json" 2>&1 | tee "$OUT/restart-h200.log" \
  | grep -v -e "^\.\.\. " -e "^- " | tail -80
echo "script: ${SECONDS} s"
