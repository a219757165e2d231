"""The toy world: a GenEval-like world of coloured shapes, the default world of every training
script.

    from common import toyworld
    img = toyworld.render("a photo of a red circle left of a blue square", seed=0)   # PIL, 32x32
    reward, correct = toyworld.score([img], ["a photo of a red circle left of a blue square"])

`prompts.py` is the grammar and the train/test split, `render.py` draws correct scenes (the
pretraining data), `scorer.py` is the reward (a pixel-exact GenEval stand-in). See each module's
docstring.
"""

from .prompts import (
    CATEGORIES,
    COLORS,
    NUMBERS,
    OPPOSITE,
    PROMPT_DIR,
    RELATIONS,
    SHAPES,
    Spec,
    all_prompts,
    balanced_mix,
    category_of,
    in_grammar,
    load_prompts,
    parse,
    prompts_from_text,
    split_prompts,
    split_validation,
    write_prompt_files,
)
from .render import RESOLUTION, render, render_array, render_batch
from .scorer import color_coverage, detect, image_grid, relation_holds, score, to_uint8

__all__ = [  # the toy world's public names, re-exported from its modules
    "CATEGORIES",
    "COLORS",
    "NUMBERS",
    "OPPOSITE",
    "PROMPT_DIR",
    "RELATIONS",
    "SHAPES",
    "Spec",
    "all_prompts",
    "balanced_mix",
    "category_of",
    "in_grammar",
    "load_prompts",
    "prompts_from_text",
    "parse",
    "split_prompts",
    "split_validation",
    "write_prompt_files",
    "RESOLUTION",
    "render",
    "render_array",
    "render_batch",
    "color_coverage",
    "detect",
    "image_grid",
    "relation_holds",
    "score",
    "to_uint8",
    "TRAIN_FILE",
    "TRAIN_MIX_FILE",
    "RL_TRAIN_FILE",
    "VAL_FILE",
    "TEST_FILE",
]

TRAIN_FILE = PROMPT_DIR / "prompts_train.txt"  # every training prompt once (the pretraining pool)
# the same, repeated so categories are equal (the shipped toy model's pretraining mix)
TRAIN_MIX_FILE = PROMPT_DIR / "prompts_train_balanced.txt"
# the RL scripts' default: the mix without the validation prompts (split_validation)
RL_TRAIN_FILE = PROMPT_DIR / "prompts_rl_train.txt"
VAL_FILE = PROMPT_DIR / "prompts_val.txt"  # for screens and choosing defaults
TEST_FILE = PROMPT_DIR / "prompts_test.txt"  # read once, for the headline
