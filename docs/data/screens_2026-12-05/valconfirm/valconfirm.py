"""Issue #48 item 1: the three GRPO defaults re-run on the RL mix without the validation prompts (5 seeds, test
prompts) and re-examined on the validation prompts against their runner-ups (2 seeds each):

    python docs/data/screens_2026-12-05/valconfirm/valconfirm.py      # from the repository root

The protocol and the rule were written before the runs (docs/results.md, "The GRPO defaults re-examined on
validation"). A gain is a run's last evaluation minus its start run's (the shipped model, the same seeds and
prompts). On validation the default's five seeds are its test runs' final weights evaluated on the validation
prompts (valeval/, 14 seeds per prompt; evaluation does not feed training); the runner-up's two seeds were trained
and read on validation by `bench_compare --split validation --final-se 0.025` (the same 14 seeds per prompt). The
rule: a default stands unless the runner-up's mean validation gain is more than RULE above the default's.
digests.tsv (written by collect.sh) holds each training run's final-weights digest beside the one its validation
evaluation loaded; the script counts the equal pairs.
Welch intervals and p, and the difference the seeds resolve (80 % power, two-sided 5 %), as in
docs/data/screens_2026-12-03/verdict/verdict.py.
"""

import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.abspath(os.path.join(DATA, "..", "..")))
sys.path.insert(0, os.path.join(DATA, "screens_2026-12-03", "verdict"))
sys.path.insert(0, os.path.join(DATA, "screens_2026-12-05", "nft"))

from nft_claim import fmt  # noqa: E402
from verdict import welch_test  # noqa: E402

from benchmarks.bench_compare import mean_ci, summarize, welch_ci  # noqa: E402

RULE = 0.035  # a runner-up must beat the default's validation gain by more than this to put the default in doubt
NAMES = {"flowgrpo_baseline": "Flow-GRPO", "g2rpo": "G²RPO", "densegrpo": "DenseGRPO"}
OLD_MIX = {  # the 5-seed runs the README's rows held before: the training mix with the validation prompts
    "flowgrpo_baseline": ["screens_2026-12-04/f30"],
    "g2rpo": ["screens_2026-12-02/g12m3"],
    "densegrpo": ["screens_2026-12-03/c"],
}
NEW_MIX = {  # the same defaults trained on prompts_rl_train.txt (test prompts)
    "flowgrpo_baseline": ["screens_2026-12-05/nft"],
    "g2rpo": ["screens_2026-12-05/valconfirm/g2_new"],
    "densegrpo": ["screens_2026-12-05/dense_new"],
}
RUNNER_UP = {  # (folder, variant, what it is), trained and read on validation
    "flowgrpo_baseline": ("fval", "lr6e-4", "learning rate 6e-4, 30 iterations"),
    "g2rpo": (
        "g2val",
        "b5x27",
        "branches at steps 0-4, 27 iterations (the default's training NFE)",
    ),
    "densegrpo": ("dval", "g8nt", "8 prompts x 8, n = t, steps 0-4, 1,200 CPU s"),
}


def finals(
    folders: list[str], algo: str, variant: str = "*"
) -> tuple[float | None, dict[int, float]]:
    """(the start run's accuracy or None, {seed: final accuracy}) over the finished runs in `folders`."""
    start, out = None, {}
    for folder in folders:
        for d in sorted(glob.glob(os.path.join(folder, f"{algo}__{variant}__*"))):
            s = summarize(d)
            if s is None:
                continue
            seed = d.rsplit("__", 1)[1]
            if seed == "start":
                start = s["final"]["acc"]
            else:
                out[int(seed)] = s["final"]["acc"]
    return start, out


def compare(a: list[float], b: list[float]) -> str:
    """a − b: Welch's interval, p and the difference these seeds resolve."""
    if len(a) < 2 or len(b) < 2:
        return "(too few seeds)"
    df, p, resolved = welch_test(a, b)
    return f"{fmt(*welch_ci(a, b))}, p {p:.2g}, resolves {resolved:.3f}"


def main() -> None:
    print(
        "Test prompts: each default, 5 seeds, on the mix with and without the validation prompts\n"
    )
    print(
        "| algorithm | old mix: gain [95 % CI] | new mix: finals | new mix: gain [95 % CI] | new − old (Welch) |"
    )
    print("|---|---|---|---|---|")
    new_mix_gains = {}
    for algo, name in NAMES.items():
        old_start, old = finals([os.path.join(DATA, f) for f in OLD_MIX[algo]], algo)
        new_start, new = finals([os.path.join(DATA, f) for f in NEW_MIX[algo]], algo)
        gains = [
            [v - old_start for v in old.values()],
            [v - new_start for v in new.values()] if new else [],
        ]
        new_mix_gains[algo] = gains[1]
        cells = [fmt(*mean_ci(g)) + f" (n = {len(g)})" if len(g) > 1 else "—" for g in gains]
        print(
            f"| {name} | {cells[0]} | {' / '.join(f'{v:.3f}' for v in new.values())} | {cells[1]} | "
            f"{compare(gains[1], gains[0])} |"
        )
    print(
        "\nThe same mix, equal batch and iterations (32 prompts x 8, 30 iterations = 7,680 trajectories), finals\n"
    )
    print("| difference | [95 % CI], p, these seeds resolve |\n|---|---|")
    nt_start, nt = finals([os.path.join(DATA, "screens_2026-12-05/nt")], "densegrpo")
    flow, dense = new_mix_gains["flowgrpo_baseline"], new_mix_gains["densegrpo"]
    print(f"| DenseGRPO default (n = 2, steps 0-4) − Flow-GRPO default | {compare(dense, flow)} |")
    print(
        "| DenseGRPO n = t, 9 steps − DenseGRPO default (n = 2, steps 0-4) | "
        f"{compare([v - nt_start for v in nt.values()], dense)} |"
    )
    with open(os.path.join(HERE, "digests.tsv")) as f:
        digests = [line.rstrip("\n").split("\t") for line in f][1:]
    same = sum(row[2] == row[3] != "" for row in digests)
    print(
        f"\nvaleval/ evaluated the training runs' own final weights: {same} of {len(digests)} digests equal"
    )
    print(
        f"\nValidation prompts: the default (its test runs' weights) against the runner-up; rule: +{RULE}\n"
    )
    print(
        "| algorithm | start | default: finals | default: gain [95 % CI] | runner-up | runner-up: finals | "
        "runner-up: gain | runner-up − default (Welch) | by the rule |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for algo, name in NAMES.items():
        folder, variant, what = RUNNER_UP[algo]
        start, ru = finals([os.path.join(HERE, folder)], algo, variant)
        _, default = finals([os.path.join(HERE, "valeval")], algo, "default")
        if start is None or not default:
            print(f"| {name} | — | — | — | {what} | not run | | | |")
            continue
        g_def, g_ru = [v - start for v in default.values()], [v - start for v in ru.values()]
        verdict = (
            "—"
            if not g_ru
            else "the default stands"
            if sum(g_ru) / len(g_ru) - sum(g_def) / len(g_def) <= RULE
            else "NOT confirmed"
        )
        print(
            f"| {name} | {start:.3f} | {' / '.join(f'{v:.3f}' for v in default.values())} | "
            f"{fmt(*mean_ci(g_def)) if len(g_def) > 1 else '—'} | {what} | "
            f"{' / '.join(f'{v:.3f}' for v in ru.values()) or '—'} | "
            f"{fmt(*mean_ci(g_ru)) if len(g_ru) > 1 else '—'} | {compare(g_ru, g_def)} | {verdict} |"
        )


if __name__ == "__main__":
    main()
