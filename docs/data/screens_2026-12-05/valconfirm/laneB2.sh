#!/usr/bin/env bash
# laneB.sh's rest, rebalanced at 05:52 (laneB.sh stopped; its running grid, pid 4580, finishes on its own)
source /work/runs_s29/common.sh
while kill -0 4580 2>/dev/null; do sleep 20; done   # DenseGRPO runner-up on validation, seeds 1 and 2
valeval flowgrpo_baseline /work/runs_s27/head 1 2 3 4 5; valeval densegrpo /work/runs_s28/dense_new 1 2 3 4 5
echo "valeval flow dense $(date -u)"
$BC --algos g2rpo --seeds 2 4 --iterations 39 --out /work/runs_s29/g2_newB; echo "g2_newB $(date -u)"
valeval g2rpo /work/runs_s29/g2_newB 2 4; echo "valeval g2 $(date -u)"
echo laneB2 done $(date -u)
