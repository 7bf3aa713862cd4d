#!/usr/bin/env bash
# On the GPU machine: where a forked worker's start goes (scripts/startup_profile.py),
# for the bundled model and the v2-lite-shaped checkpoint.
set -u
export PYTHONUNBUFFERED=1
P="python3 -m preload.cli.main"
$P start --device cuda:0 --state-dir /tmp/sd1 --health-port 0 2>&1 | tail -2
python3 scripts/startup_profile.py /tmp/sd1 2>&1 | tee $OUT/prof-bundled.txt | head -80
$P stop --state-dir /tmp/sd1 2>&1 | tail -1
$P make-checkpoint --shape v2-lite --out /tmp/v2-lite 2>&1 | tail -1
$P start --model /tmp/v2-lite --device cuda:0 --state-dir /tmp/sd2 --health-port 0 2>&1 | tail -2
python3 scripts/startup_profile.py /tmp/sd2 2>&1 | tee $OUT/prof-v2lite.txt | head -80
$P stop --state-dir /tmp/sd2 2>&1 | tail -1
