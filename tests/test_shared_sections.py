"""The three GRPO scripts share their training section (and everything after it) and the helper that scores a
stored step, line for line: only the rollout and the algorithm's Args differ, so `diff flowgrpo_baseline.py g2rpo.py`
shows the algorithm and nothing else. (diffusionnft.py has no transitions and its own training section.)"""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = "        # ============================ TRAINING on transitions"
LOG_PROB = "# ============================ SHARED: the log-prob of a stored step"
END_OF_SHARED = "# ================================================= END OF SHARED"


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def training_tail(text):
    assert TRAINING in text, "lost its TRAINING banner"
    return text[text.index(TRAINING) :]


def log_prob_block(text):
    assert LOG_PROB in text and END_OF_SHARED in text, "lost its SHARED log-prob banners"
    return text[text.index(LOG_PROB) : text.index(END_OF_SHARED)]


@pytest.mark.parametrize("script", ["g2rpo.py", "densegrpo.py"])
@pytest.mark.parametrize("section", [training_tail, log_prob_block])
def test_shared_sections_are_the_baselines(script, section):
    assert section(read(script)) == section(read("flowgrpo_baseline.py"))


def test_the_checker_sees_a_changed_line():
    text = read("flowgrpo_baseline.py")
    changed = text.replace("    rows, position, first = mb\n", "    rows, first, position = mb\n")
    assert changed != text and log_prob_block(changed) != log_prob_block(text)
    assert training_tail(
        text.replace("scaler.scale(loss).backward()", "scaler.scale(2 * loss).backward()")
    ) != training_tail(text)
