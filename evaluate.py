"""
Held-out evaluation: the policy's greedy accuracy and unbiased pass@k on the test
prompts. Each rank samples its share of them and the counts are summed over ranks, so
the numbers are the same on 1 GPU and on 8. train.py calls evaluate every eval_interval
iterations; its warm start asks greedy_hits when it may stop.

Right means one verifier's score >= 1, whatever else the run is rewarded for
(with_accuracy).
"""
import torch

from data import default_reward
from reward import get_reward_fns, pass_at_k
from rollout import prompt_seed, sample, score
from lib.measure import ticker
from lib.parallelism import all_sum, gathered, stopping


# the built-in reward functions that say whether an answer is right, as opposed to how
# it is shaped
VERIFIERS = ('exact_match', 'final_answer_match', 'numeric_match', 'countdown_reward')


def with_accuracy(cfg, train_rows, reward_fns, reward_weights):
    """
    The accuracy's function, whose score >= 1 makes an answer right in the log's acc,
    the held-out evaluations and the warm start's stop: accuracy_func where the config
    names one, else the first verifier (VERIFIERS) among the reward functions, wherever
    it is listed, else the task's own (data.default_reward's first). Never another
    reward, since one like brevity, 1 / (1 + length), gives an empty answer 1. A
    function the run does not list joins it with weight 0, to be scored and logged but
    never learnt from. Returns (reward_fns, reward_weights, accuracy, a note naming the
    function and why it is the one).
    """
    listed = {name: fn for name, fn in zip(cfg.reward_funcs, reward_fns)}
    listed.update({fn.__name__: fn for fn in reward_fns})
    task_verifier = default_reward(cfg.task, train_rows)[0][0]
    if cfg.accuracy_func:
        name, why = cfg.accuracy_func, 'accuracy_func'
    else:
        name = next((fn.__name__ for fn in reward_fns
                     if fn.__name__ in VERIFIERS), task_verifier)
        why = ("the task's verifier" if name == task_verifier
               else "the first verifier listed")
    accuracy = listed.get(name) or get_reward_fns(name)[0]
    if accuracy not in reward_fns:
        reward_fns, reward_weights = reward_fns + [accuracy], reward_weights + [0.0]
        why += ', weight 0: scored, not learnt from'
    return reward_fns, reward_weights, accuracy, f"{accuracy.__name__} ({why})"


@torch.no_grad()
def greedy_hits(model, rows, seeds, cfg, enc, accuracy, tick=lambda done: None):
    """
    How many of rows the greedy completion gets right (accuracy >= 1), and the texts of
    the first three. The prompts go through the sampler prompts_per_step / world_size at
    a time, the rollout's own batch, which is what fits in memory. A stop signal ends it
    early: its caller drops the count.
    """
    per, hits, texts = max(1, cfg.prompts_per_step // cfg.world_size), 0, []
    for i in range(0, len(rows), per):
        if stopping():
            break
        part = rows[i:i + per]
        _, tokens, mask, _, record = sample(model, part, seeds[i:i + per], cfg, enc,
                                            temperature=0.0, num_samples=1)
        correct, _, done, _ = score(part, tokens, mask, cfg, enc, [accuracy], [1.0],
                                    num_samples=1, record=record)
        hits, texts = hits + (correct >= 1).sum().item(), texts + done[:3 - len(texts)]
        tick(i + len(part))
    return hits, texts


@torch.no_grad()
def evaluate(model, test_rows, it, rank, cfg, enc, accuracy, every):
    """
    Held-out greedy accuracy and unbiased pass@k (k = 1, 2, 4.. up to G) over all ranks,
    a progress line every `every` seconds, and this rank's first prompts with their
    greedy completions; right means that `accuracy` scores 1 or more. Under FSDP the
    whole weights are gathered once, for all the sampler's steps. A stop signal ends it
    early, every rank still summing its counts: train.py then drops the numbers.
    """
    rows = test_rows[rank::cfg.world_size]
    # the same seeds at every evaluation: the numbers move only when the policy does
    seeds = [prompt_seed(cfg.seed, -1, j)
             for j in range(rank, len(test_rows), cfg.world_size)]
    per, G, c = max(1, cfg.prompts_per_step // cfg.world_size), cfg.num_generations, []
    with gathered(model):
        greedy, texts = greedy_hits(
            model, rows, seeds, cfg, enc, accuracy,
            ticker(f"eval {it}, greedy", len(rows), 'prompts', every))
        tick = ticker(f"eval {it}, sampled", len(rows), 'prompts', every)
        for i in range(0, len(rows), per):
            if stopping():
                break
            part = rows[i:i + per]
            _, tokens, mask, _, record = sample(model, part, seeds[i:i + per], cfg, enc)
            correct, _, _, _ = score(part, tokens, mask, cfg, enc, [accuracy], [1.0],
                                     record=record)
            # correct samples per prompt
            c += (correct >= 1).view(-1, G).sum(1).tolist()
            tick(i + len(part))
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= G] + ([G] if G & (G - 1) else [])
    counts = [greedy, len(rows)] + [sum(pass_at_k(G, ci, k) for ci in c) for k in ks]
    sums = all_sum(torch.tensor(counts, dtype=torch.float64)).tolist()
    out = {'eval/greedy_acc': sums[0] / sums[1]}
    out.update({f'eval/pass@{k}': v / sums[1] for k, v in zip(ks, sums[2:])})
    return out, list(zip([r['prompt'] for r in rows], texts))


def report(metrics, samples, it):
    """The evaluation's lines: greedy accuracy and pass@k, then the first prompts with
    their greedy completions."""
    passes = " | ".join(f"{k[5:]} {v:.3f}" for k, v in metrics.items() if 'pass' in k)
    first = f"eval {it}: greedy acc {metrics['eval/greedy_acc']:.3f} | {passes}"
    return "\n".join([first] + [f"    {p!r} -> {c!r}" for p, c in samples])
