#!/usr/bin/env bash
# On the GPU machine, in one device call: the GPU tests, then the restart figures for the
# v2-lite-shaped checkpoint (31 GB) alone (the whole scripts/h200_restart.sh takes ~7.5 min).
set -u
export PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -m gpu -q tests/gpu -p no:cacheprovider -rA --tb=short 2>&1 | tee "$OUT/gpu-tests.log" | tail -16
echo "tests done after ${SECONDS} s"
python3 -m preload.cli.main make-checkpoint --shape v2-lite --out /tmp/v2-lite 2>&1 | tail -1
python3 -m preload.cli.main bench restart --device cuda:0 --no-small --large /tmp/v2-lite \
  --restarts 10 --cold-repeat 1 --memory-workers 4 --json "$OUT/restart-v2lite-h200.json" 2>&1 | tee "$OUT/restart-v2lite-h200.log" \
  | grep -v -e "^\.\.\. " -e "^- " | tail -40
echo "script: ${SECONDS} s"
