#!/usr/bin/env bash
# laneA.sh's rest, rebalanced at 05:52 (laneA.sh stopped; its running grid, pid 4577, finishes on its own)
source /work/runs_s29/common.sh
while kill -0 4577 2>/dev/null; do sleep 20; done   # G²RPO default, new mix, seeds 1 and 3 (test)
$BC --algos g2rpo --seeds 1 2 --iterations 39 --split validation --final-se 0.025 \
  --variants "b5x27=--branch-steps 0 1 2 3 4 --num-iterations 27" --out /work/runs_s29/g2val; echo "g2val $(date -u)"
$BC --algos g2rpo --seeds 5 --iterations 39 --out /work/runs_s29/g2_new; echo "g2_new 5 $(date -u)"
$BC --algos flowgrpo_baseline --seeds 1 2 --iterations 30 --split validation --final-se 0.025 \
  --variants "lr6e-4=--learning-rate 6e-4" --out /work/runs_s29/fval; echo "fval $(date -u)"
valeval g2rpo /work/runs_s29/g2_new 1 3 5; echo "valeval g2 $(date -u)"
echo laneA2 done $(date -u)
