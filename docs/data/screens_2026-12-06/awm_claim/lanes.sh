#!/bin/bash
# Issue #69 items 4-5: AWM's toy default beside Flow-GRPO's and DiffusionNFT's, 5 seeds each, the three scripts
# side by side (one lane each, one thread per run), each at its default iterations, read on the test prompts.
#   bash docs/data/screens_2026-12-06/awm_claim/lanes.sh OUT     (from the repository root)
# As it ran (2026-12-06, from a worktree at 797ff7a, whose awm.py trains the same weights as the final commit's:
# one default iteration, sha256 0f72b567eacd0593 both; Flow-GRPO's and DiffusionNFT's scripts changed after it in
# comments and imports only): the three lanes from 08:30 UTC; at seed 2 the machine
# restarted (09:45) and the lanes were started again (bench_compare keeps finished runs and starts unfinished
# ones from nothing); to end within the session, AWM's and Flow-GRPO's seed 5 ran in two more lanes (the same
# command with --seeds 5 and its own OUT, the start run copied in), from 09:58 and 10:27, and the two lanes
# above were stopped before their seed 5 (lane_*.log). So 3 to 5 runs shared the 2 cores at any time.
OUT=${1:-runs/awm_claim}
run() { python benchmarks/bench_compare.py --algos "$1" --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations "$2" --eval-every "$3" --out "$OUT"; }
run awm 18 3 > "$OUT.awm.log" 2>&1 &
run flowgrpo_baseline 30 10 > "$OUT.flow.log" 2>&1 &
run diffusionnft 20 10 > "$OUT.nft.log" 2>&1 &
wait
