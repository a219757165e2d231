#!/usr/bin/env bash
# after laneB2.sh: Flow-GRPO's runner-up seed 2 (its own folder, so the two lanes never share a start run)
source /work/runs_s29/common.sh
while pgrep -f laneB2.sh >/dev/null; do sleep 20; done
$BC --algos flowgrpo_baseline --seeds 2 --iterations 30 --split validation --final-se 0.025 \
  --variants "lr6e-4=--learning-rate 6e-4" --out /work/runs_s29/fvalB; echo "fvalB $(date -u)"
echo laneB3 done $(date -u)
