"""Every "paper:" value a script quotes is its own paper's (issue #17.4).

`python g2rpo.py --help` is where a student learns the paper's setting, so a flag docstring of g2rpo.py that quotes
Flow-GRPO's resolution (512) as "paper: 512" teaches something false. This test reads each script's `Args` (with
`ast`, no torch import), finds every `paper: ...` / `(paper 4.5 ...` clause in a flag docstring and checks each
number in it against a table of that script's paper, kept below with the section of /work/shared/reference/*.md
it was read from. A flag that quotes a paper value but is not in its paper's table fails too: add it, with its
source, after checking it. Elsewhere in the file (comments, error messages) a "paper:" number must at least be one
of the paper's values.

A clause runs from "paper" to the next ")" or ";", so "(paper: 16; the released code evaluates with 50)" quotes 16
only. Numbers glued to a name (FLUX.1, SD3.5-M, epsilon_1, Fig. 6b) are not values.

Issue #37.4 (diffs that show the algorithm): a flag that all three scripts share has ONE docstring, word for word, so
`diff flowgrpo_baseline.py g2rpo.py` shows no help text of a shared flag; such a docstring quotes no paper, and each
paper's values live in the "## Paper preset" section of its docs page instead: a runnable command, which is parsed
here with the script's own `Args` (tyro) and checked against the paper's table below, and a table of its sources.
"""

import ast
import importlib
import os
import re

import pytest

from benchmarks.presets import DOCS, PRESET, preset_command, read

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The paper tables: flag -> the values the paper (or, where marked, its official code) gives for it.
FLOW_GRPO = {  # Liu et al., arXiv 2505.05470; reference/flowgrpo.md §3.4 (SD3.5-M configs), §2.1, §3.1
    "resolution": {512},  # §3.4: 512, latents 16x64x64
    "lora_rank": {32},
    "lora_alpha": {64},  # §3.4 LoRA row (SD3.5-M; FLUX's train_flux.py: 64 / 128)
    "num_steps": {10, 40},  # §3.4: 10 rollout steps, 40 at evaluation
    "eval_num_steps": {40},  # §3.4, §9
    "guidance_scale": {4.5},  # §3.4: CFG 4.5 at rollout, training forward and evaluation
    "noise_level": {0.7},  # §2.1: a = 0.7 for SD3.5-M
    "group_size": {24},  # §3.4: G = 24 (Fig. 5: 12 and 6 collapse)
    "groups_per_iteration": {48},  # §3.4: group_number = 48
    "beta": {0.04, 0.01},  # §3.4: 0.04 GenEval and OCR, 0.01 PickScore
    "timestep_fraction": {0.99},  # §3.4: 9 of 10 steps
    "learning_rate": {3e-4},  # §3.4: AdamW 3e-4 with the LoRA
    # §3.4: grad accumulation num_batches // 2 = 2 steps per epoch
    "optimizer_steps_per_iteration": {2},
    "clip_range": {1e-4},
    "adv_clip_max": {5},  # §3.4
    "ema_decay": {0.9},
    "ema_update_interval": {8},  # §3.4 EMA row (official code: flow_grpo/ema.py)
    "mixed_precision": {"fp16"},  # §3.4 (official code; README FAQ prefers fp16 on SD3)
    "max_sequence_length": {128},  # §3.4: T5 max_sequence_length 128
}
G2RPO = {  # Zhou et al., arXiv 2510.01982; reference/g2rpo.md §3.3 (hyperparameter table), §1.2, §2.1, §1.3
    "resolution": {720},  # §3.3: 720x720 (the released vis_flux.py evaluates at 1024)
    "num_steps": {16},  # §3.3: T = 16
    "shift": {3},  # §3.3: shift 3
    "guidance_scale": {3.5},  # §1.3: FLUX.1-dev distilled guidance 3.5, no CFG
    "noise_level": {0.7},  # §1.3, §3.3: eta = 0.7
    "group_size": {12},  # §3.3: G = 12
    "groups_per_iteration": {16},  # §3.3: 1 prompt per GPU, 16 GPUs
    # §1.2: M = {16, ..., 9} of T = 16, 8 steps (code: --eta_step_list 0..7)
    "branch_steps": {
        *range(10),
        16,
    },
    "granularities": {1, 2, 3},  # §2.1: paper Lambda = {1, 2, 3} (scripts {1, 2})
    "adv_clip_max": {5},  # §3.3: "epsilon = 5"
    "learning_rate": {2e-6},  # §3.3: AdamW 2e-6, full fine-tune
    "weight_decay": {1e-4},
    "max_grad_norm": {1.0},  # §3.3
    # §3.1/§3.2: one step per iteration (the (1/|M|) sum; hps: one per k)
    "optimizer_steps_per_iteration": {1},
    "eval_num_steps": {50, 10, 20},  # §4.4 (code: 50), §5 Table 3 (10, 20)
}
DENSE_GRPO = {  # Deng et al., arXiv 2601.20218 v2; reference/densegrpo.md §4.2 (hyperparameter table), §3.2
    "resolution": {512},  # §4.2: 512x512
    "lora_rank": {32},
    "lora_alpha": {64},  # §4.2: r = 32, alpha = 64 (paper)
    "num_steps": {10, 40},  # §4.2: T = 10, 40 at evaluation
    "eval_num_steps": {40},  # §4.2
    "group_size": {24},  # §4.2: G = 24
    # §4.2: global batch 144 x accumulation 8 = 1152 = 48 x 24
    "groups_per_iteration": {
        48,
        24,
        144,
        8,
    },
    "beta": {0.04, 0.01},  # §4.2: 0.04 GenEval and OCR, 0.01 PickScore
    "learning_rate": {3e-4},  # §4.2: AdamW 3e-4 (paper + code)
    "optimizer_steps_per_iteration": {1},  # §4.2: one optimizer step per 1152 images (App. A)
    "calibration_step": {0.01},  # §3.2: epsilon_2 = 0.01 (App. A)
    "balance_threshold": {2},  # §3.2: epsilon_1 = 2 (App. A)
    "noise_level": {0.7},  # §6.2 Fig. 6b: the uniform-noise ablation a = 0.7
}
DIFFUSION_NFT = {  # Zheng et al., arXiv 2509.16117; NVlabs/DiffusionNFT config/nft.py and base.py
    "resolution": {512},
    "lora_rank": {32},
    "lora_alpha": {64},
    "num_steps": {10},  # config: sample.num_steps = 10, dpm2, guidance 1.0
    "eval_num_steps": {40},
    "group_size": {24},
    "groups_per_iteration": {48},
    "timestep_fraction": {0.99},
    "nft_beta": {1.0},  # train.beta in the loss (0.1 for OCR and the multi-reward run)
    "kl_weight": {1e-4},
    "adv_clip_max": {5},
    "learning_rate": {3e-4},
    "weight_decay": {1e-4},
    "max_grad_norm": {1.0},
    "ema_decay": {0.9},
    "optimizer_steps_per_iteration": {1},
}
AWM = {  # Xue et al., arXiv 2509.25050; scxue/advantage_weighted_matching at be51372, config/dgx_awm.py (the 1-node
    # GenEval, OCR and PickScore configs), config/base_awm.py, scripts/train_sd3_awm.py; reference/awm.md §3
    "resolution": {512},
    "max_sequence_length": {128},
    "mixed_precision": {"fp16"},
    "lora_rank": {32},
    "lora_alpha": {64},
    "num_steps": {14},
    "noise_level": {0.4, 0.0},  # SA-Solver's tau: GenEval and OCR 0.4, PickScore 0.0
    "noise_window": {0.3, 0.9},  # `0.3 <= t <= 0.9` in sd3_pipeline_with_logprob.py
    "guidance_scale": {1.0},
    "eval_guidance_scale": {1.0},
    "group_size": {24},
    "groups_per_iteration": {72, 24},  # 36 (PickScore: 12) batches x 6 images x 8 GPUs / 24
    "rollout_batch_size": {6},
    "train_batch_size": {3, 2},  # train.batch_size: GenEval and OCR 3, PickScore 2
    "optimizer_steps_per_iteration": {1},
    "burn_in_iterations": {2},
    "std_eps": {1e-4},
    "adv_clip_max": {5},
    "advantage_max": {1},
    "train_timesteps": {6},
    "timestep_fraction": {0.9},
    "time_type": {"discrete_wo_init", "discrete"},  # PickScore: discrete
    "weighting": {"ghuber"},
    "ghuber_power": {0.25},
    "kl_weight": {0.001, 0.003, 0.0001},  # train.beta: GenEval (since be51372), OCR, PickScore
    "ema_kl_weight": {1},  # train.ema_beta
    "kl_ema_decay": {0.3},
    "learning_rate": {3e-4},
    "adam_betas": {0.9, 0.999},
    "weight_decay": {1e-4},
    "max_grad_norm": {1.0},
    "ema_decay": {0.99},
    "ema_update_interval": {1},
    "eval_num_steps": {40},
    "eval_batch_size": {6},
    "eval_every": {50, 20},  # eval_freq: GenEval and PickScore 50, OCR 20
    "save_every": {50, 20},
    "seed": {42},
}
SCRIPTS = {
    "flowgrpo_baseline.py": FLOW_GRPO,
    "g2rpo.py": G2RPO,
    "densegrpo.py": DENSE_GRPO,
    "diffusionnft.py": DIFFUSION_NFT,
    "awm.py": AWM,
}
GRPO_SCRIPTS = ("flowgrpo_baseline.py", "g2rpo.py", "densegrpo.py")

CLAUSE = re.compile(r"\bpaper(?::|\s+(?=\d))\s*(?P<clause>[^;)]*)")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?(?!\w|\.\d)")


def clause_values(clause: str) -> set:
    """The values a clause quotes: its numbers, or (none) its first word ("fp16")."""
    nums = {float(n) for n in NUMBER.findall(clause)}
    if nums:
        return nums
    words = clause.split()
    return {words[0].strip(",.")} if words else set()


def norm(values) -> set:
    return {float(v) if not isinstance(v, str) else v for v in values}


def args_docstrings(source: str) -> dict[str, str]:
    """flag name -> docstring of the `Args` dataclass (a string statement right after the annotated field)."""
    cls = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Args"
    )
    docs = {}
    for field, doc in zip(cls.body, cls.body[1:]):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = doc.value.value
    return docs


def check_source(source: str, table: dict) -> list[str]:
    """Every mismatch between the "paper" clauses of a script's source and its paper's table, one line each."""
    errors = []
    for flag, doc in args_docstrings(source).items():
        for m in CLAUSE.finditer(doc):
            got = clause_values(m["clause"])
            clause = " ".join(m.group(0).split())
            if flag not in table:
                errors.append(
                    f"--{flag.replace('_', '-')}: '{clause}' is not in the paper table of this test; check "
                    "it against /work/shared/reference and add it (with its section), or drop it"
                )
            elif not got or not got <= norm(table[flag]):
                errors.append(
                    f"--{flag.replace('_', '-')}: '{clause}' quotes {sorted(map(str, got))}, but the "
                    f"paper's value is {sorted(map(str, table[flag]))}"
                )
    union = set().union(*map(norm, table.values()))
    cls = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Args"
    )
    for n, line in enumerate(source.splitlines(), 1):
        if cls.lineno <= n <= cls.end_lineno:  # checked flag by flag above
            continue
        for m in CLAUSE.finditer(line):
            # numbers only: prose is free here
            got = {float(x) for x in NUMBER.findall(m["clause"])}
            if not got <= union:
                errors.append(
                    f"line {n}: '{m.group(0).strip()}' quotes {sorted(map(str, got))}, none of this "
                    "script's paper values"
                )
    return errors


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_paper_value_is_the_scripts_own_paper(script):
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        source = f.read()
    errors = check_source(source, SCRIPTS[script])
    assert not errors, f"{script}:\n  " + "\n  ".join(errors)


def test_the_check_finds_another_papers_value():
    """The failure the test exists for: a G2RPO flag quoting Flow-GRPO's numbers, or a flag not in the table."""
    src = '''
@dataclass
class Args:
    resolution: int = 32
    """image size (paper: 512 for SD3.5-M)"""
    guidance_scale: float = 1.0
    """CFG (SD3; paper 4.5) or FLUX guidance"""
    num_steps: int = 16
    """steps (paper: 16; the released code evaluates with 50)"""
    lora_rank: int = 16
    """LoRA rank r (paper: 32)"""
'''
    errors = check_source(src, G2RPO)
    assert [e.split(":")[0] for e in errors[:3]] == [
        "--resolution",
        "--guidance-scale",
        "--lora-rank",
    ], errors
    assert "not in the paper table" in errors[2]
    assert (
        check_source(
            src.replace("512 for SD3.5-M", "720, FLUX.1-dev")
            .replace("paper 4.5", "paper: 3.5")
            .replace("LoRA rank r (paper: 32)", "none"),
            G2RPO,
        )
        == []
    )


def test_clause_values():
    assert clause_values("720, FLUX.1-dev") == {720.0} and clause_values("512 for SD3.5-M") == {
        512.0
    }
    assert [m["clause"] for m in CLAUSE.finditer("(paper: 16; the released code: 50)")] == ["16"]
    assert clause_values("0.04, 0.01 for PickScore") == {0.04, 0.01}
    assert clause_values("2e-6, full fine-tuning") == {2e-6}
    assert clause_values("epsilon_1 = 2") == {2.0}
    assert clause_values("fp16") == {"fp16"}


# ------------------------------------------------- issue #37.4: one docstring per shared flag, paper values in docs
def args_fields(source: str) -> list[str]:
    """The field names of the `Args` dataclass, in order."""
    cls = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Args"
    )
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]


def harness_fields() -> set[str]:
    """The flags common/plumbing/harness.py declares once for every script (HarnessArgs, GRPOArgs)."""
    tree = ast.parse(read("common/plumbing/harness.py"))
    return {
        n.target.id
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name in ("HarnessArgs", "GRPOArgs")
        for n in c.body
        if isinstance(n, ast.AnnAssign)
    }


def redeclared_help(source: str, shared: set[str]) -> list[str]:
    """One line per harness flag that a script's `Args` declares again with help of its own (it may
    change the default, as exp_name does, and take the harness's one-line help)."""
    cls = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Args"
    )
    body, errors = cls.body, []
    for k, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign) and stmt.target.id in shared and k + 1 < len(body):
            nxt = body[k + 1]
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                errors.append(f"--{stmt.target.id.replace('_', '-')} has help of its own here")
    return errors


def test_every_shared_flag_has_one_help_in_common():
    """The flags every script shares live once in common/plumbing/harness.py with one line of help; a script
    declares its algorithm's flags, with help about its algorithm, and may override a shared flag's
    default without repeating its help. A paper's value is not help (tyro prints the default): it
    goes to the script's docs page, "## Paper preset"."""
    shared = harness_fields()
    assert len(shared) >= 40, (
        f"only {len(shared)} flags in common/plumbing/harness.py: parsing broke?"
    )
    errors = [f"{s}: {e}" for s in SCRIPTS for e in redeclared_help(read(s), shared)]
    assert not errors, "\n  ".join(
        ["a shared flag's help is in common/plumbing/harness.py only:"] + errors
    )


def preset_errors(script: str, doc_text: str, table: dict) -> list[str]:
    """Every way the doc's paper preset for `script` misses its paper's table: a flag of the table not on the command
    line (tyro's spelling), a value not the table's (one of them, where it lists several), a flag without a row in the
    section's table, a command that the script's `Args` cannot parse or its check_args refuses."""
    import tyro

    module = importlib.import_module(script[: -len(".py")])
    argv, world_size = preset_command(doc_text, script)
    fields = {f.name: f for f in module.Args.__dataclass_fields__.values()}
    given = set()
    for tok in argv:
        if tok.startswith("--"):
            name = tok[2:].replace("-", "_")
            given.add(name[3:] if name.startswith("no_") and name[3:] in fields else name)
    try:
        args = tyro.cli(module.Args, args=argv)
    except SystemExit as e:
        return [
            f"{script}: the preset does not parse with its Args (tyro exit {e.code}): {' '.join(argv)}"
        ]
    errors = []
    body = PRESET.search(doc_text)["body"]
    for flag, values in table.items():
        spelled = "--" + flag.replace("_", "-")
        if flag not in fields:
            continue
        if flag not in given:
            errors.append(f"{spelled} is in the paper's table but not on the preset's command line")
        got = getattr(args, flag)
        got_values = set(got) if isinstance(got, tuple) else {got}
        if not got_values or not norm(got_values) <= norm(values):
            errors.append(
                f"{spelled} {got} in the preset, but the paper's value is {sorted(map(str, values))}"
            )
        if f"| `{spelled}` |" not in body:
            errors.append(
                f"{spelled} has no row `| `{spelled}` | paper value | source |` in the Paper preset table"
            )
    if not errors:
        try:
            module.check_args(args, world_size)
        except SystemExit as e:  # ConfigError: its one-line message says what to change
            errors.append(f"the preset fails {script}'s check_args at world size {world_size}: {e}")
    return errors


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_paper_preset_is_the_papers(script):
    errors = preset_errors(script, read(DOCS[script]), SCRIPTS[script])
    assert not errors, f"{DOCS[script]}, ## Paper preset:\n  " + "\n  ".join(errors)


def test_the_checks_see_a_changed_value_or_docstring():
    """Both checks can fail: one preset value changed, one flag dropped, or one shared docstring reworded."""
    doc = read(DOCS["g2rpo.py"])
    changed = doc.replace("--group-size 12 ", "--group-size 24 ", 1)
    assert changed != doc
    assert any(
        "--group-size 24 in the preset" in e for e in preset_errors("g2rpo.py", changed, G2RPO)
    )
    dropped = doc.replace("--weight-decay 1e-4 ", "", 1)
    assert dropped != doc
    assert any(
        "--weight-decay is in the paper's table" in e
        for e in preset_errors("g2rpo.py", dropped, G2RPO)
    )
    text = read("densegrpo.py")
    assert redeclared_help(text, harness_fields()) == []
    cut = text.index("\n", text.index("    exp_name: str")) + 1
    changed = text[:cut] + '    """my help"""\n' + text[cut:]
    assert redeclared_help(changed, harness_fields()) == ["--exp-name has help of its own here"]
