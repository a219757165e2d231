#!/bin/bash
# Issue #69 items 4-5: AWM's toy default beside Flow-GRPO's and DiffusionNFT's, 5 seeds each, the three scripts
# side by side (one lane each, one thread per run), each at its default iterations, read on the test prompts.
#   bash docs/data/screens_2026-12-06/awm_claim/lanes.sh OUT     (from the repository root)
OUT=${1:-runs/awm_claim}
run() { python benchmarks/bench_compare.py --algos "$1" --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations "$2" --eval-every "$3" --out "$OUT"; }
run awm 18 3 > "$OUT.awm.log" 2>&1 &
run flowgrpo_baseline 30 10 > "$OUT.flow.log" 2>&1 &
run diffusionnft 20 10 > "$OUT.nft.log" 2>&1 &
wait
