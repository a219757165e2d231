"""The plumbing: everything a run needs that is not an algorithm, which a student does not have to
open to follow an iteration (docs/design.md has the map). The set-up and flags (harness), the loop's
bookkeeping and metrics (run), the rollout-to-training contract and the gradient diagnostic
(transitions), checkpoints and the run folder (checkpoint), flag and file checks (checks),
evaluation, pictures (plots), DDP/FSDP2 (parallel), distributed set-up and logging (utils), remote
rewards and the reward server, and the tiny models the tests build."""
