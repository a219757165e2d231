#!/usr/bin/env bash
# laneA2.sh's rest, rebalanced at 06:53 (laneA2.sh stopped; its running grid, pid 5372, finishes on its own):
# Flow-GRPO's runner-up seed 2 moves to the other lane (laneB3.sh, folder fvalB)
source /work/runs_s29/common.sh
while kill -0 5372 2>/dev/null; do sleep 20; done   # G²RPO runner-up on validation, seeds 1 and 2
$BC --algos g2rpo --seeds 5 --iterations 39 --out /work/runs_s29/g2_new; echo "g2_new 5 $(date -u)"
$BC --algos flowgrpo_baseline --seeds 1 --iterations 30 --split validation --final-se 0.025 \
  --variants "lr6e-4=--learning-rate 6e-4" --out /work/runs_s29/fval; echo "fval $(date -u)"
valeval g2rpo /work/runs_s29/g2_new 1 3 5; echo "valeval g2 $(date -u)"
echo laneA3 done $(date -u)
