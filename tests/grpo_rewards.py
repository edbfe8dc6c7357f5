"""Reward functions for the GRPO tests (--reward-funcs grpo_rewards:NAME; the tests' folder is
on the path of the test process and of launched ranks)."""


def digits(completions, references, prompts):
    """The share of a completion's characters that are digits: a reward a tiny model learns in
    a few iterations (about 4% of the byte vocabulary at the start)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def wrong_length(completions, references, prompts):
    return [1.0]


def boom(completions, references, prompts):
    """A user's function that fails: named in one line, the run stopped with its checkpoints kept."""
    raise RuntimeError("boom")
