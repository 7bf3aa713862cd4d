#!/usr/bin/env bash
# On the GPU machine: GPU tests, then cold-start figures for the bundled model and a
# v2-lite-shaped checkpoint (31 GB). Results land in $OUT (JSON and logs).
set -u
export PYTHONUNBUFFERED=1
python3 -m pytest -m gpu -q tests/gpu -p no:cacheprovider -rA --tb=short -s 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
python3 -m preload.cli.main bench cold --device cuda:0 --repeat 3 --transformers --json "$OUT/cold-bundled-h200.json" 2>&1 | tail -12

python3 -m preload.cli.main make-checkpoint --shape v2-lite --out /tmp/v2-lite 2>&1 | tail -2

python3 -m preload.cli.main bench cold --model /tmp/v2-lite --device cuda:0 --quant none,fp8_block --repeat 2 --no-warmup \
  --transformers --json "$OUT/cold-v2lite-h200.json" 2>&1 | tail -14
