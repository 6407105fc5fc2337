"""
evaluate.py: what counts as a right answer. The accuracy (the log's acc, the held-out evaluation, the
warm start's stop) is a verifier's score >= 1, whatever order the reward functions are listed in.
"""
import math
from types import SimpleNamespace

import torch

import evaluate
from evaluate import with_accuracy
from reward import exact_match, numeric_match
from lib.tokenizer import get_tokenizer


def brevity(prompts, completions, **kwargs):
    """README's example of a reward of one's own: shorter is better, and an empty answer scores 1."""
    return [1 / (1 + len(c)) for c in completions]


def run_cfg(**changes):
    """The settings with_accuracy and evaluate read, for the built-in addition task."""
    enc = get_tokenizer('bytes')
    return SimpleNamespace(**dict(dict(task='addition', reward_funcs=(), accuracy_func='', world_size=1, seed=0,
                                       prompts_per_step=4, num_generations=2, max_completion_length=4,
                                       eos_ids=[enc.eot_token], environment=None), **changes)), enc


def test_the_accuracy_is_the_verifier_whatever_reward_comes_first():
    """README's --reward_funcs="('myrewards:brevity', 'exact_match')": brevity is listed first, but the
    accuracy is exact_match, the task's verifier, in either order; the weights stay as given."""
    for names, fns in ((('myrewards:brevity', 'exact_match'), [brevity, exact_match]),
                       (('exact_match', 'myrewards:brevity'), [exact_match, brevity])):
        cfg, _ = run_cfg(reward_funcs=names)
        got_fns, weights, accuracy, note = with_accuracy(cfg, [], fns, [1.0, 1.0])
        assert accuracy is exact_match and got_fns == fns and weights == [1.0, 1.0]
        assert note == "exact_match (the task's verifier)"


def test_a_run_without_a_verifier_is_still_measured_by_the_task_s():
    """Only brevity to learn from: the task's verifier joins the reward functions with weight 0, so
    acc and the evaluations still say how many answers are right, and the loss never sees it."""
    cfg, _ = run_cfg(reward_funcs=('myrewards:brevity',))
    fns, weights, accuracy, note = with_accuracy(cfg, [], [brevity], [1.0])
    assert accuracy is exact_match and fns == [brevity, exact_match] and weights == [1.0, 0.0]
    assert note.startswith("exact_match (the task's verifier, weight 0")


def test_a_listed_verifier_or_the_named_one_is_the_accuracy():
    """A verifier the config lists (numeric_match, on a task whose own is exact_match, as
    config/smollm2.py does) is the accuracy; accuracy_func overrides both, even with a reward that
    is not a verifier."""
    cfg, _ = run_cfg(task='times_table', reward_funcs=('myrewards:brevity', 'numeric_match'))
    _, _, accuracy, note = with_accuracy(cfg, [], [brevity, numeric_match], [0.1, 1.0])
    assert accuracy is numeric_match and note == 'numeric_match (the first verifier listed)'
    cfg, _ = run_cfg(reward_funcs=('myrewards:brevity', 'exact_match'), accuracy_func='myrewards:brevity')
    _, _, accuracy, note = with_accuracy(cfg, [], [brevity, exact_match], [1.0, 1.0])
    assert accuracy is brevity and note == 'brevity (accuracy_func)'


def test_an_empty_answer_is_not_right_in_the_held_out_evaluation(monkeypatch):
    """The case README's example ran into: a policy that answers nothing. Brevity gives every empty
    answer 1, so taking the first function as the accuracy read 100%; the verifier reads 0%."""
    cfg, enc = run_cfg(reward_funcs=('myrewards:brevity', 'exact_match'))
    rows = [{'prompt': f'{a}+{a}=', 'answer': str(2 * a)} for a in range(6)]

    def empty(model, part, seeds, cfg, enc, temperature=None, num_samples=None):
        """Every completion is the end of text alone, which the reward functions read as ''."""
        n = len(part) * (num_samples or cfg.num_generations)
        tokens = torch.full((n, cfg.max_completion_length), cfg.eos_ids[0])
        mask = torch.zeros(n, cfg.max_completion_length, dtype=torch.bool)
        mask[:, 0] = True
        return None, tokens, mask, None, None
    monkeypatch.setattr(evaluate, 'sample', empty)
    _, _, accuracy, _ = with_accuracy(cfg, rows, [brevity, exact_match], [1.0, 1.0])
    model = torch.nn.Linear(1, 1)
    held_out = lambda fn: evaluate.evaluate(model, rows, 0, 0, cfg, enc, fn, math.inf)[0]
    assert held_out(accuracy) == {'eval/greedy_acc': 0.0, 'eval/pass@1': 0.0, 'eval/pass@2': 0.0}
    assert held_out(brevity)['eval/greedy_acc'] == 1.0  # what the first function would have said
