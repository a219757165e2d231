"""Prompt grammar of the toy world: GenEval's phrasing, restricted to 6 colours x 3 shapes.

Four GenEval task categories, each an exact template:

    single      a photo of a red circle
    counting    a photo of three red circles
    two_object  a photo of a red circle and a blue square
    position    a photo of a red circle left of a blue square
                ("A left of B": A's centroid is left of B's)

The train/test split is a *compositional* hold-out: a test prompt never appears in training, but
every colour, shape and number word does, so the test measures whether the model can recombine known
parts.
"""

import functools
import itertools
import random
import re
from dataclasses import dataclass
from pathlib import Path

COLORS = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "magenta": (255, 0, 255),
    "cyan": (0, 255, 255),
}
SHAPES = ("circle", "square", "triangle")
CATEGORIES = ("single", "counting", "two_object", "position")
NUMBERS = {"two": 2, "three": 3, "four": 4}
RELATIONS = ("left of", "right of", "above", "below")
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}

PROMPT_DIR = Path(__file__).parent
TEST_COUNTS = {"single": 12, "counting": 24, "two_object": 32, "position": 32}
SPLIT_SEED = 0
# the validation split, carved from the training prompts (split_validation): singles are capped by
# the 6 training singles, counting by keeping every combination in RL training
VAL_COUNTS = {"single": 3, "counting": 8, "two_object": 16, "position": 32}
VAL_SEED = 1

_C, _S = "|".join(COLORS), "|".join(SHAPES)
_OBJ = rf"a ({_C}) ({_S})"
_PATTERNS = {
    "single": re.compile(rf"a photo of {_OBJ}"),
    "counting": re.compile(rf"a photo of ({'|'.join(NUMBERS)}) ({_C}) ({_S})s"),
    "two_object": re.compile(rf"a photo of {_OBJ} and {_OBJ}"),
    "position": re.compile(rf"a photo of {_OBJ} ({'|'.join(RELATIONS)}) {_OBJ}"),
}


@dataclass(frozen=True)
class Spec:
    """What a prompt asks for. `objects` is a tuple of (color, shape, count); for position prompts
    objects[0] is A and objects[1] is B in "A <relation> B"."""

    category: str
    objects: tuple
    relation: str | None = None

    @property
    def prompt(self) -> str:
        """The prompt string (inverse of `parse`)."""
        (c0, s0, n0), *rest = self.objects
        if self.category == "single":
            return f"a photo of a {c0} {s0}"
        if self.category == "counting":
            word = {v: k for k, v in NUMBERS.items()}[n0]
            return f"a photo of {word} {c0} {s0}s"
        ((c1, s1, _),) = rest
        middle = "and" if self.category == "two_object" else self.relation
        return f"a photo of a {c0} {s0} {middle} a {c1} {s1}"


@functools.lru_cache(maxsize=16384)  # prompts repeat a lot in training; Spec is immutable
def parse(prompt: str) -> Spec:
    """Parse a prompt of the grammar into a Spec; raise ValueError for anything else."""
    for category, pattern in _PATTERNS.items():
        m = pattern.fullmatch(prompt)
        if m is None:
            continue
        g = m.groups()
        if category == "single":
            return Spec(category, ((g[0], g[1], 1),))
        if category == "counting":
            return Spec(category, ((g[1], g[2], NUMBERS[g[0]]),))
        a, b = (g[0], g[1]), (g[-2], g[-1])
        if a == b:
            raise ValueError(f"prompt {prompt!r}: the two objects must differ in colour or shape")
        relation = g[2] if category == "position" else None
        return Spec(category, ((*a, 1), (*b, 1)), relation)
    raise ValueError(
        f"prompt {prompt!r} is not in the toy-world grammar; expected one of "
        "'a photo of a red circle', 'a photo of three red circles', "
        "'a photo of a red circle and a blue square', 'a photo of a red circle left of a blue "
        f"square' (colours {list(COLORS)}, shapes {list(SHAPES)}, relations {list(RELATIONS)})"
    )


def category_of(prompt: str) -> str:
    return parse(prompt).category


def in_grammar(prompt: str) -> bool:
    """True if `prompt` is a toy-world prompt (the scripts then also report GenEval-style
    accuracy)."""
    try:
        parse(prompt)
        return True
    except ValueError:
        return False


def all_prompts(category: str) -> list[str]:
    """Every prompt of one category, in a fixed order (18 / 54 / 306 / 1224 prompts)."""
    pairs = list(itertools.product(COLORS, SHAPES))
    if category == "single":
        return [Spec(category, ((c, s, 1),)).prompt for c, s in pairs]
    if category == "counting":
        return [Spec(category, ((c, s, n),)).prompt for n in NUMBERS.values() for c, s in pairs]
    ordered = [(a, b) for a in pairs for b in pairs if a != b]
    if category == "two_object":
        return [Spec(category, ((*a, 1), (*b, 1))).prompt for a, b in ordered]
    if category == "position":
        return [Spec(category, ((*a, 1), (*b, 1)), r).prompt for r in RELATIONS for a, b in ordered]
    raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


def split_prompts() -> tuple[list[str], list[str]]:
    """The fixed, seeded (train, test) split.

    * single: keep 6 of 18 for training, one per colour with each shape twice, so every colour and
      every shape is still seen on its own; the other 12 are held out.
    * counting: hold out 24 of 54, but keep every (colour, shape), (number, colour) and
      (number, shape) combination in training.
    * two_object / position: "A and B" shows the same scene as "B and A", and "A left of B" the same
      as "B right of A", so held-out prompts are chosen in such equivalence groups: 16 unordered
      pairs (x2 orders) and 8 (unordered pair, axis) groups (x4 phrasings).
    """
    rng = random.Random(SPLIT_SEED)
    colors, shapes = list(COLORS), list(SHAPES)
    rng.shuffle(colors)
    rng.shuffle(shapes)
    keep = {Spec("single", ((c, shapes[i % 3], 1),)).prompt for i, c in enumerate(colors)}
    test = {"single": [p for p in all_prompts("single") if p not in keep]}

    counting = all_prompts("counting")
    while True:
        held = set(rng.sample(counting, TEST_COUNTS["counting"]))
        train = [parse(p).objects[0] for p in counting if p not in held]
        if all(
            len({key(o) for o in train}) == n
            for key, n in [
                (lambda o: o[:2], 18),
                (lambda o: (o[2], o[0]), 18),
                (lambda o: (o[2], o[1]), 9),
            ]
        ):
            break
    test["counting"] = [p for p in counting if p in held]

    pairs = [frozenset(ab) for ab in itertools.combinations(itertools.product(COLORS, SHAPES), 2)]
    held_pairs = set(rng.sample(pairs, TEST_COUNTS["two_object"] // 2))
    test["two_object"] = [
        p
        for p in all_prompts("two_object")
        if frozenset(o[:2] for o in parse(p).objects) in held_pairs
    ]
    axis = {"left of": "x", "right of": "x", "above": "y", "below": "y"}
    groups = [(pair, ax) for pair in pairs for ax in "xy"]
    held_groups = set(rng.sample(groups, TEST_COUNTS["position"] // 4))
    test["position"] = [
        p
        for p in all_prompts("position")
        if (frozenset(o[:2] for o in parse(p).objects), axis[parse(p).relation]) in held_groups
    ]

    test_all = [p for c in CATEGORIES for p in test[c]]
    held_set = set(test_all)
    train_all = [p for c in CATEGORIES for p in all_prompts(c) if p not in held_set]
    return train_all, test_all


def split_validation(train: list[str]) -> tuple[list[str], list[str]]:
    """The fixed, seeded (RL training, validation) split of the training prompts: every screen and
    every choice of a default reads the validation prompts, so the test prompts are read once, for
    the headline. Carved like the test split, so a validation prompt's scene is never trained on:

    * single: 3 of the 6 training singles, one per shape (each shape is still trained on its own).
    * counting: 8 of 30, keeping every (colour, shape), (number, colour) and (number, shape)
      combination in RL training.
    * two_object / position: whole equivalence groups, 8 unordered pairs (x2 orders) and 8
      (unordered pair, axis) groups (x4 phrasings).

    The pretrained toy model saw every training prompt, validation ones included (its pretraining
    pool is prompts_train.txt); the test prompts it never saw. Validation is held out from RL only.
    """
    rng = random.Random(VAL_SEED)
    by_cat = {c: [p for p in train if category_of(p) == c] for c in CATEGORIES}
    singles = by_cat["single"]
    val = {"single": []}
    for shape in SHAPES:  # one single per shape, a random one of the two
        val["single"].append(rng.choice([p for p in singles if parse(p).objects[0][1] == shape]))

    counting = by_cat["counting"]
    while True:
        held = set(rng.sample(counting, VAL_COUNTS["counting"]))
        kept = [parse(p).objects[0] for p in counting if p not in held]
        if all(
            len({key(o) for o in kept}) == len({key(parse(p).objects[0]) for p in counting})
            for key in (lambda o: o[:2], lambda o: (o[2], o[0]), lambda o: (o[2], o[1]))
        ):
            break
    val["counting"] = [p for p in counting if p in held]

    def group_of(p: str, category: str):  # the equivalence group a prompt's scene belongs to
        spec = parse(p)
        pair = tuple(sorted(o[:2] for o in spec.objects))  # sorted: the same for both orders
        if category == "two_object":
            return pair
        return (pair, "x" if spec.relation in ("left of", "right of") else "y")

    for category, size in (("two_object", 2), ("position", 4)):
        groups = sorted({group_of(p, category) for p in by_cat[category]})
        groups = [
            g for g in groups if sum(group_of(p, category) == g for p in by_cat[category]) == size
        ]
        held_groups = set(rng.sample(groups, VAL_COUNTS[category] // size))
        val[category] = [p for p in by_cat[category] if group_of(p, category) in held_groups]

    val_all = [p for c in CATEGORIES for p in val[c]]
    held_set = set(val_all)
    return [p for p in train if p not in held_set], val_all


def balanced_mix(train: list[str]) -> list[str]:
    """The category-balanced mix: every category equally often, as the accuracy weighs them.

    The grammar itself is lopsided (of the 1502 training prompts 1192 are position prompts and 6 are
    single objects), so sampling its prompts uniformly would train almost only on position. Like
    Flow-GRPO's GenEval training file (a weighted merge of per-task prompt lists), the mix repeats
    prompts: each category gets as many lines as the largest one, cycling through its prompts, so
    within a category every prompt is (almost) equally likely too. A script samples the lines of a
    prompt file uniformly. prompts_train_balanced.txt is the pretraining pool's mix (the shipped toy
    model was pretrained on it); prompts_rl_train.txt is the RL scripts' default, the same without
    the validation prompts.
    """
    by_cat = {c: [p for p in train if category_of(p) == c] for c in CATEGORIES}
    n = max(len(v) for v in by_cat.values())
    return [by_cat[c][i % len(by_cat[c])] for c in CATEGORIES for i in range(n)]


def write_prompt_files(directory: str | Path = PROMPT_DIR) -> None:
    """Write the prompt files (run once; they are committed): the pretraining pool and its mix, the
    RL training mix, the validation and the test prompts."""
    train, test = split_prompts()
    rl_train, val = split_validation(train)
    files = {
        "prompts_train.txt": train,
        "prompts_train_balanced.txt": balanced_mix(train),
        "prompts_rl_train.txt": balanced_mix(rl_train),
        "prompts_val.txt": val,
        "prompts_test.txt": test,
    }
    for name, prompts in files.items():
        (Path(directory) / name).write_text("\n".join(prompts) + "\n")


def load_prompts(path: str | Path) -> list[str]:
    """Read one prompt per line, skipping blank lines (a UTF-8 byte-order mark is not a prompt)."""
    return prompts_from_text(Path(path).read_text(encoding="utf-8-sig"), path)


def prompts_from_text(text: str, path: str | Path) -> list[str]:
    """The prompts of a prompt file's text (`path` names it in the error of an empty one)."""
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} is empty: expected one prompt per line")
    return prompts
