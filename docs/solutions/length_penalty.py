"""
Lesson exercise 2: a reward of your own, in a file of your own, with reward.py's interface.

A reward function takes the prompts, the completions and every column the rollout passes (see reward.py's
docstring) and returns one float (or None) per completion. This one takes the two columns it needs by name and
swallows the rest with **kwargs. Train with it next to the accuracy, at a small weight:

    PYTHONPATH=docs/solutions python train.py \
        --reward_funcs="('exact_match', 'length_penalty:length_penalty')" --reward_weights="(1.0, 0.1)"

With a weight w < 1 a right answer (1 - w x its share) always outranks a wrong one (at most 0), so the penalty only
orders answers that are equally right or equally wrong: the shorter one gets the larger advantage.
"""


def length_penalty(prompts, completions, completion_ids, max_completion_length, **kwargs):
    """-(tokens / max_completion_length) per completion: near 0 for a short answer, -1 for one that uses the whole
    budget. Tokens, not characters, since tokens are what a completion costs; the eos counts when it was sampled."""
    return [-len(ids) / max_completion_length for ids in completion_ids]
