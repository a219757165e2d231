"""The three scripts share their training section (and everything after it) line for line: only the rollout
and the algorithm's Args differ, so `diff flowgrpo_baseline.py g2rpo.py` shows the algorithm and nothing else."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "        # =============================== TRAINING on transitions"


def shared_tail(name):
    with open(os.path.join(ROOT, name)) as f:
        text = f.read()
    assert MARKER in text, f"{name} lost its TRAINING banner"
    return text[text.index(MARKER):]


@pytest.mark.parametrize("script", ["g2rpo.py", "densegrpo.py"])
def test_training_section_is_the_baselines(script):
    assert shared_tail(script) == shared_tail("flowgrpo_baseline.py")
