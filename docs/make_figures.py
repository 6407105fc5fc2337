"""
The figures of docs/, computed by the project's own functions (loss.py, rollout.py, model.py, sampling.py) and
from real runs of train.py, then drawn with matplotlib. Nothing here re-computes what those files compute.

$ python docs/make_figures.py          # every figure into docs/figures/, and the numbers the pages quote to stdout
$ python docs/make_figures.py --check  # the same code at toy sizes (2 iterations a run), drawn into a temp dir

--check never touches docs/figures/; without matplotlib both compute every figure's data and skip the drawing.
Either exits non-zero on any failure (tests/test_docs.py runs --check). The full run trains three runs of the
default task side by side, one thread each, so its wall time is mostly theirs; the decode timing runs after them,
with the machine to itself.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from fractions import Fraction

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from lib import checkpoint  # noqa: E402
from data import default_reward, load_dataset  # noqa: E402
from loss import LOSS_TYPES, grpo_loss, group_advantages, kl_divergence  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from reward import get_reward_fns  # noqa: E402
from rollout import is_flat, make_batch, rollout  # noqa: E402
from sampling import sample  # noqa: E402
from configurator import run_config  # noqa: E402
from lib.chat import load_template  # noqa: E402
from lib.tokenizer import get_tokenizer  # noqa: E402

DT = torch.float64
# the runs: the default recipe with room to ramble (completions of up to 32 tokens, not 8), no evaluation
# (len_correct and len_wrong come from the rollouts) and no matmul peak measurement (MFU is not plotted)
BASE = ['config/dr_grpo.py', '--max_completion_length=32', '--eval_interval=0', '--save_interval=0',
        '--peak_flops=1e12']
RUNS = {'grpo': ['--loss_type=grpo'], 'dr_grpo': [], 'dynamic': ['--dynamic_sampling=True']}
SIZES = {  # full: what the pages quote; check: the same code paths in seconds
    'full': dict(iters=300, train=[], window=25, draws=400_000, repeats=5, prompts=8, steps=128,
                 decoder=dict(n_layer=4, n_head=4, n_embd=256, vocab_size=8192)),
    'check': dict(iters=2, window=1, draws=4000, repeats=1, prompts=2, steps=16,
                  decoder=dict(n_layer=1, n_head=2, n_embd=32, vocab_size=512),
                  train=['--n_layer=1', '--n_head=2', '--n_embd=32', '--sft_iters=3', '--sft_batch_size=8',
                         '--prompts_per_step=4', '--num_generations=4', '--micro_batch_size=4']),
}
COLORS = dict(grpo='tab:red', bnpo='tab:orange', dr_grpo='tab:blue', dapo='tab:green', luspo='tab:purple',
              dynamic='tab:green')


def train_runs(work, size):
    """The runs of RUNS in work/<name>/ (metrics.jsonl and a final checkpoint each). One warm start, copied into
    each (train.py reuses a warm start whose config matches), then the runs side by side, a thread each."""
    env = dict(os.environ, OMP_NUM_THREADS='1')
    args = [sys.executable, 'train.py', *BASE, *size['train']]
    warm = os.path.join(work, 'warm')
    subprocess.run(args + ['--max_iters=0', f'--out_dir={warm}'], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    procs = {}
    for name, flags in RUNS.items():
        out = os.path.join(work, name)
        shutil.copytree(os.path.join(warm, 'warmstart'), os.path.join(out, 'warmstart'))
        with open(os.path.join(out, 'train.log'), 'w') as log:
            procs[name] = subprocess.Popen(args + flags + [f'--max_iters={size["iters"]}', f'--out_dir={out}'],
                                           cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    for name, p in procs.items():
        if p.wait():
            with open(os.path.join(work, name, 'train.log')) as f:
                sys.exit(f"error: run {name} failed:\n{f.read()[-3000:]}")
    return {name: os.path.join(work, name) for name in RUNS}


def metrics(run):
    with open(os.path.join(run, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def series(rows, key):
    """One metric over the iterations; NaN where train.py left it out (len_correct when no answer was right)."""
    return [r.get(key, math.nan) for r in rows]


def mean(values):
    """The mean of the values that are not NaN (NaN if none is)."""
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def smooth(values, window):
    """Trailing mean over `window` iterations."""
    return [mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def real_rollout(run, **overrides):
    """One call of the trainer's rollout() with the run's final policy, on the prompts of the iteration after its
    last, under the run's config (saved in its checkpoint) changed by overrides. The reference model, when beta > 0,
    is the run's warm start: the policy RL started from. Returns (batch, info, policy, cfg)."""
    state = checkpoint.load_state(run)
    # the keys older runs lack, at their defaults
    config = {'plain': False, 'truncate_logprobs': True, 'max_rows': 0, 'env': '', 'stop_tokens': (),
              **state['config'], **overrides}
    enc = get_tokenizer(config['tokenizer'])
    template = load_template(config['chat_template'], config['tokenizer'], config.get('chat_date'))
    cfg = run_config(dict(config, device='cpu'), enc=enc, template=template, world_size=1)
    policy = GPT.from_pretrained(state['dir'])
    ref = GPT.from_pretrained(os.path.join(run, 'warmstart')) if cfg.beta > 0 else None
    rows = load_dataset(cfg.task, 'train', seed=cfg.seed, **cfg.task_options)
    names, weights = default_reward(cfg.task, rows)  # what the runs were scored with: they name no reward_funcs
    reward_fns = get_reward_fns(names)
    groups, info = rollout(policy, rows, state['iter'], 0, cfg, enc, reward_fns, weights)
    batch = make_batch(policy, ref, groups=groups, info=info, rank=0, cfg=cfg, reward_weights=weights)
    return batch, info, policy, cfg


def save(plt, fig, out, name, top=1.0):
    fig.tight_layout(rect=(0, 0, 1, top))  # top < 1 leaves room for a legend above the panels
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    print(f"drew {name}")


# -----------------------------------------------------------------------------
# normalisers.md

def fig_normaliser_weights(plt, out):
    """Each token's weight, -d loss / d logp / A, by autograd through grpo_loss, for one group of a short (4 tokens,
    A = +1) and a long (16 tokens, A = -1) completion; max_completion_length 16, the step one micro-batch."""
    lengths, L = [4, 16], 16
    mask = torch.arange(L) < torch.tensor(lengths)[:, None]  # (2, L)
    adv = torch.tensor([1.0, -1.0], dtype=DT)
    weights = {}
    for loss_type in LOSS_TYPES:
        logps = torch.full((2, L), -1.0, dtype=DT, requires_grad=True)
        loss, _ = grpo_loss(logps, None, None, adv, mask, loss_type=loss_type, max_completion_length=L)
        w = (-torch.autograd.grad(loss, logps)[0][:, 0] / adv).tolist()  # on-policy every token of a row weighs alike
        weights[loss_type] = w
        print(f"normalisers: {loss_type:7s} one token: short {w[0]:.4f} long {w[1]:.4f} | whole completion: short "
              f"{w[0] * lengths[0]:.3f} long {w[1] * lengths[1]:.3f}")
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, scale, what in ((axes[0], [1, 1], 'one token'), (axes[1], lengths, 'a whole completion')):
        for i, loss_type in enumerate(LOSS_TYPES):
            short, long_ = (w * n for w, n in zip(weights[loss_type], scale))
            bars = ax.bar(i - 0.2, short, 0.4, color=COLORS[loss_type], edgecolor='black',
                          label='4 tokens, A = +1' if i == 0 else None)
            ax.bar_label(bars, [str(Fraction(short).limit_denominator(1000))], fontsize=8)  # exact: 1/32, not 0.03125
            bars = ax.bar(i + 0.2, long_, 0.4, color='white', edgecolor=COLORS[loss_type], hatch='//',
                          label='16 tokens, A = -1' if i == 0 else None)
            ax.bar_label(bars, [str(Fraction(long_).limit_denominator(1000))], fontsize=8)
        ax.set(xticks=range(len(LOSS_TYPES)), xticklabels=LOSS_TYPES, yscale='log', xlabel='loss_type',
               ylabel='weight = gradient / (-A), log scale', title=f'weight of {what}')
        ax.tick_params(axis='y', which='minor', labelleft=False)
        ax.grid(axis='y', alpha=0.3)
        ax.legend(fontsize=9)
    save(plt, fig, out, 'normaliser_weights.png')


def fig_length_bias(plt, out, runs, window):
    """Mean length of the right and the wrong completions, and the share cut off at the length limit, over two real
    runs that differ only in loss_type: grpo against dr_grpo."""
    data = {name: metrics(runs[name]) for name in ('grpo', 'dr_grpo')}
    keys = ('len_correct', 'len_wrong', 'truncated')
    for name, rows in data.items():
        print(f"length bias: {name:7s} first {window} iterations " +
              " ".join(f"{k} {mean(series(rows[:window], k)):.3f}" for k in keys + ('acc',)) +
              f" | last {window} " + " ".join(f"{k} {mean(series(rows[-window:], k)):.3f}" for k in keys + ('acc',)))
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    titles = ('right answers: mean length', 'wrong answers: mean length', 'cut off at 32 tokens')
    for ax, key, title in zip(axes, keys, titles):
        for name, rows in data.items():
            ax.plot(series(rows, 'iter'), smooth(series(rows, key), window), color=COLORS[name],
                    label=f'loss_type={name}')
        ax.set(xlabel='iteration', title=title, ylabel=('share of completions' if key == 'truncated' else 'tokens') +
               f', mean of {window} iterations')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    save(plt, fig, out, 'length_bias.png')


# -----------------------------------------------------------------------------
# surrogates.md

SURROGATES = {  # label: (grpo_loss keyword arguments, tokens in the sequence, has an objective in r)
    'PPO clip, eps 0.2': (dict(), 1, True),
    'clip-higher, eps 0.2 / 0.28': (dict(epsilon_high=0.28), 1, True),
    'dual clip, delta 3': (dict(delta=3.0), 1, True),
    'SAPO, tau 1 / 1.05': (dict(surrogate='sapo'), 1, True),
    'GSPO, eps 0.2, 1 of 4 tokens moves': (dict(importance_sampling_level='sequence'), 4, True),
    'CISPO, cap 5': (dict(surrogate='cispo', epsilon_high=5.0), 1, False),
    'VESPO, defaults': (dict(surrogate='vespo'), 1, False),
}


def fig_surrogates(plt, out):
    """Objective and gradient of one token against its ratio r = pi / pi_old, by grpo_loss and autograd. A sequence
    is that token alone, or for GSPO four tokens of which only the first moves (the sequence ratio is r^(1/4));
    loss_type luspo (a token sum), so the gradient is the token's own."""
    r = torch.cat([torch.logspace(-1, 1, 161, dtype=DT), torch.tensor([0.5, 1.5, 4.0], dtype=DT)]).sort().values
    curves = {}
    for label, (kw, T, _) in SURROGATES.items():
        for A in (1.0, -1.0):
            values, grads = [], []
            for x in r.tolist():
                logps = torch.zeros(1, T, dtype=DT)
                logps[0, 0] = math.log(x)
                logps.requires_grad_(True)
                loss, _ = grpo_loss(logps, torch.zeros(1, T, dtype=DT), None, torch.tensor([A], dtype=DT),
                                    torch.ones(1, T, dtype=torch.bool), loss_type='luspo', **kw)
                values.append(-loss.item() / T)  # per token
                grads.append(-torch.autograd.grad(loss, logps)[0][0, 0].item() / A)
            curves[label, A] = values, grads
    for label in SURROGATES:
        at = lambda A, x: curves[label, A][1][r.tolist().index(x)] + 0.0  # the grid holds x exactly; + 0.0: no -0
        print(f"surrogates: {label:36s} gradient / A at r = 0.5, 1, 1.5, 4: A > 0 " +
              " ".join(f"{at(1.0, x):5.2f}" for x in (0.5, 1, 1.5, 4)) + " | A < 0 " +
              " ".join(f"{at(-1.0, x):5.2f}" for x in (0.5, 1, 1.5, 4)))
    if plt is None:
        return
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True)
    styles = ['-', '--', '-.', ':', '-', '--', '-.']
    for (label, (_, _, has_objective)), style, color in zip(SURROGATES.items(), styles, plt.cm.tab10.colors):
        for col, A in enumerate((1.0, -1.0)):
            values, grads = curves[label, A]
            if has_objective:
                axes[0, col].plot(r, values, style, color=color, label=label, lw=1.8)
            axes[1, col].plot(r, grads, style, color=color, label=label, lw=1.8)
    for col, sign in enumerate(('A = +1 (a better than average completion)', 'A = -1 (a worse one)')):
        axes[0, col].set(title=f'objective per token, {sign}', ylabel='objective (minus the loss)')
        axes[1, col].set(title=f'gradient, {sign}', xlabel='token ratio r = pi / pi_old (log scale)',
                         ylabel='d objective / d log pi, divided by A', xscale='log')
        axes[1, col].set_xticks([0.1, 0.25, 0.5, 0.8, 1.2, 2, 3, 5, 10], ['0.1', '0.25', '0.5', '0.8', '1.2', '2',
                                                                        '3', '5', '10'])
        for ax in axes[:, col]:
            ax.axvline(1.0, color='grey', lw=0.8)
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, title='CISPO, VESPO: no objective in r', title_fontsize=8)
    axes[1, 1].legend(fontsize=8, loc='upper left')
    save(plt, fig, out, 'surrogates.png')


# -----------------------------------------------------------------------------
# kl.md

def fig_kl_estimators(plt, out):
    """k1, k2, k3 (loss.kl_divergence) against the exact KL(pi || pi_ref) over a 10-token vocabulary, as the
    policy's logits drift from the reference's along a fixed random direction: each estimator's mean and standard
    deviation over a token drawn from pi, computed exactly (a pi-weighted sum over the vocabulary, no sampling)."""
    g = torch.Generator().manual_seed(0)
    ref_logits, direction = torch.randn(2, 10, generator=g, dtype=DT)
    drift = torch.linspace(0, 3, 61, dtype=DT)
    logp_ref = torch.log_softmax(ref_logits, -1).expand(len(drift), -1)  # (D, V)
    logq = torch.log_softmax(ref_logits + drift[:, None] * direction, -1)  # (D, V)
    q = logq.exp()
    exact = (q * (logq - logp_ref)).sum(-1)  # (D,)
    stats = {}
    for estimator in ('k1', 'k2', 'k3'):
        k = kl_divergence(logq, logp_ref, estimator)  # (D, V): the estimate if token v is drawn
        mean = (q * k).sum(-1)
        stats[estimator] = mean, (q * (k - mean[:, None]) ** 2).sum(-1).sqrt()
    for i in (10, 20, 40, 60):
        print(f"kl estimators: drift {drift[i].item():.1f} exact KL {exact[i].item():.3f} | " +
              " | ".join(f"{e} mean {m[i].item():.3f} std {s[i].item():.3f}" for e, (m, s) in stats.items()))
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(drift, exact, color='black', lw=3, alpha=0.4, label='exact KL(pi || pi_ref)')
    for (estimator, (mean, std)), style in zip(stats.items(), ('-', '--', ':')):
        axes[0].plot(drift, mean, style, label=f'{estimator}: mean over tokens')
        axes[1].plot(drift, std, style, label=estimator)
    axes[0].set(ylabel='nats per token', title='what each estimator averages to')
    axes[1].set(ylabel='standard deviation of one token\'s estimate', title='how noisy one token\'s estimate is')
    for ax in axes:
        ax.set(xlabel='drift of the policy from the reference (logit scale)')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    save(plt, fig, out, 'kl_estimators.png')


def fig_kl_placement(plt, out, run):
    """One real rollout (the run's final policy, its warm start as the reference), advantages with the GRPO recipe's
    scale_rewards='group' and beta 0.04: the KL in the loss (advantages from the reward alone) against
    kl_in_reward=True (the sequence's summed KL subtracted from its reward first). Same seeds: the same samples."""
    kw = dict(beta=0.04, scale_rewards='group', kl_estimator='k3')
    in_loss, info, _, cfg = real_rollout(run, kl_in_reward=False, **kw)
    in_reward, _, _, _ = real_rollout(run, kl_in_reward=True, **kw)
    G = cfg.num_generations
    kl = (kl_divergence(in_loss['old_logps'], in_loss['ref_logps'], 'k3') * in_loss['mask']).sum(1)  # (B,)
    flat = is_flat(info['rewards'], G).tolist()
    delta = (in_reward['advantages'] - in_loss['advantages']).abs().view(-1, G).mean(1)  # (groups,)
    for kind, want in (('mixed', False), ('flat', True)):
        part = [d for d, f in zip(delta.tolist(), flat) if f == want]
        print(f"kl placement: {len(part)} {kind} groups, mean |A(kl in reward) - A(kl in loss)| "
              f"{sum(part) / max(len(part), 1):.3f}")
    print(f"kl placement: summed KL per completion: mean {kl.mean().item():.3f} max {kl.max().item():.3f}")
    groups = [flat.index(False) if False in flat else 0, flat.index(True) if True in flat else len(flat) - 1]
    for g in groups:
        rows = slice(g * G, (g + 1) * G)
        print(f"kl placement: group {g} rewards {info['rewards'][rows].tolist()} KL "
              f"{[round(x, 3) for x in kl[rows].tolist()]}\n  A (kl in loss) "
              f"{[round(x, 3) for x in in_loss['advantages'][rows].tolist()]}\n  A (kl in reward) "
              f"{[round(x, 3) for x in in_reward['advantages'][rows].tolist()]}")
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, g in zip(axes, groups):
        rows, x = slice(g * G, (g + 1) * G), torch.arange(G)
        ax.bar(x - 0.2, in_loss['advantages'][rows], 0.4, label='KL in the loss: A from the reward alone')
        ax.bar(x + 0.2, in_reward['advantages'][rows], 0.4, label='kl_in_reward: A from reward - beta KL')
        ax.set_xticks(x.tolist(), [f"R={r:g}\nKL={k:.2f}" for r, k in zip(info['rewards'][rows].tolist(),
                                                                        kl[rows].tolist())], fontsize=8)
        kind = 'all rewards equal (a flat group)' if flat[g] else 'rewards differ'
        ax.set(ylabel='advantage', title=f'one group of {G}: {kind}')
        ax.axhline(0, color='black', lw=0.8)
        ax.grid(axis='y', alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc='upper center', ncol=2, fontsize=9)
    save(plt, fig, out, 'kl_placement.png', top=0.92)


# -----------------------------------------------------------------------------
# on_policy.md

def fig_on_policy(plt, out, run):
    """One real step: a rollout of the run's final policy, the trainer's forward with gradient, grpo_loss on-policy
    (old_logps=None) under every loss_type; the gradient against the plain policy gradient of the run's loss_type,
    -sum_i A_i sum_t log pi(o_i,t) / (B C), written out here as the thing to compare with."""
    batch, info, policy, cfg = real_rollout(run)
    B, C = batch['mask'].shape
    logps = policy(batch['idx'], batch['start'], C, cfg.temperature)  # (B, C), with gradient
    params = list(policy.parameters())
    flat = lambda grads: torch.cat([g.flatten() for g in grads])
    losses, norms = {}, {}
    for loss_type in LOSS_TYPES:
        loss, stats = grpo_loss(logps, None, None, batch['advantages'], batch['mask'], loss_type=loss_type)
        grad = flat(torch.autograd.grad(loss, params, retain_graph=True))
        losses[loss_type], norms[loss_type] = loss.item(), grad.norm().item()
        if loss_type == cfg.loss_type:
            ours = grad
        print(f"on-policy step: {loss_type:7s} loss {losses[loss_type]: .3e} gradient norm {norms[loss_type]:.3e} "
              f"ratio/mean {stats['ratio/mean'].item()} clip {stats['clip_ratio/region'].item()}")
    plain = -(batch['advantages'][:, None] * logps * batch['mask']).sum() / (B * C)
    pg = flat(torch.autograd.grad(plain, params))
    print(f"on-policy step: {B} completions, reward {info['rewards'].mean().item():.3f}, {len(pg)} parameters, max "
          f"|{cfg.loss_type} gradient - policy gradient| {(ours - pg).abs().max().item():.2e} of max |gradient| "
          f"{pg.abs().max().item():.2e}")
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    pick = torch.randperm(len(pg), generator=torch.Generator().manual_seed(0))[:20000]
    lim = pg[pick].abs().max().item()
    axes[0].plot([-lim, lim], [-lim, lim], color='grey', lw=0.8, ls='--', label='y = x')
    axes[0].scatter(pg[pick], ours[pick], s=4, label=f'a parameter ({len(pick)} of {len(pg)} drawn)')
    axes[0].set(xlabel='plain policy gradient, -sum A log pi / (B C)',
                ylabel=f'gradient of grpo_loss, loss_type {cfg.loss_type}',
                title=f'one real step: max |difference| = {(ours - pg).abs().max().item():.1e}')
    axes[0].legend(fontsize=9)
    x = torch.arange(len(LOSS_TYPES))
    values = [abs(losses[t]) for t in LOSS_TYPES]
    bars = axes[1].bar(x - 0.2, [max(v, 1e-12) for v in values], 0.4, label='|loss| (0 drawn at 1e-12)')
    axes[1].bar_label(bars, [f'{v:.1e}' if v else '0' for v in values], fontsize=8)
    bars = axes[1].bar(x + 0.2, [norms[t] for t in LOSS_TYPES], 0.4, label='gradient norm')
    axes[1].bar_label(bars, fmt='%.2g', fontsize=8)
    axes[1].set(xticks=x.tolist(), xticklabels=LOSS_TYPES, yscale='log', xlabel='loss_type', ylim=(1e-13, 1e5),
                title='the same step: loss value and gradient norm')
    axes[1].legend(fontsize=9, loc='upper left', ncol=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    save(plt, fig, out, 'on_policy.png')


# -----------------------------------------------------------------------------
# advantages.md

ESTIMATORS = {  # label: (scale_rewards, advantage_estimator)
    'group std (GRPO)': ('group', 'grpo'), 'batch std': ('batch', 'grpo'), 'none (Dr. GRPO)': ('none', 'grpo'),
    'RLOO': ('none', 'rloo'), 'REINFORCE++': ('none', 'reinforce_pp'),
}


def fig_advantages(plt, out):
    """group_advantages for the same 0/1 rewards of four groups of 8: 1, 4, 7 and 8 right answers."""
    right = [1, 4, 7, 8]
    rewards = torch.tensor([float(i < n) for n in right for i in range(8)], dtype=DT)
    table = {}
    for label, (scale, estimator) in ESTIMATORS.items():
        adv = group_advantages(rewards, 8, scale, estimator).view(4, 8)
        table[label] = adv[:, 0].tolist(), adv[:, 7].tolist()  # a right answer (first), a wrong one (last)
        print(f"advantages: {label:17s} right answer " + " ".join(f"{a:6.3f}" for a in table[label][0]) +
              " | wrong answer " + " ".join(f"{a:6.3f}" for a in table[label][1]))
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    x, width = torch.arange(4), 0.16
    for col, what in enumerate(('a right answer (reward 1)', 'a wrong answer (reward 0)')):
        for k, (label, values) in enumerate(table.items()):
            shown = [v if col == 0 or n < 8 else math.nan for v, n in zip(values[col], right)]  # 8/8: no wrong one
            axes[col].bar(x + (k - 2) * width, shown, width, label=label)
        axes[col].set(xticks=x.tolist(), xticklabels=[f'{n}/8 right' for n in right], xlabel='group',
                      title=f'advantage of {what}', xlim=(-0.5, 3.5))
        axes[col].axhline(0, color='black', lw=0.8)
        axes[col].grid(axis='y', alpha=0.3)
    axes[0].text(3, 0.15, 'a flat group:\n0 under all', ha='center', fontsize=9)
    axes[1].text(3, -0.6, 'no wrong\nanswer', ha='center', fontsize=9)
    axes[0].set(ylabel='advantage')
    axes[1].legend(fontsize=8)
    save(plt, fig, out, 'advantages.png')


def fig_flat_groups(plt, out, runs, window):
    """The share of flat groups over a real run of the default recipe, and what dynamic_sampling=True does: the
    flat groups it drops and resamples per iteration, and the share left in the batch it trains on."""
    plain, dynamic = metrics(runs['dr_grpo']), metrics(runs['dynamic'])
    flat = series(plain, 'flat_groups')
    print(f"flat groups: dr_grpo flat share first {window} iterations {mean(flat[:window]):.3f}, last {window} "
          f"{mean(flat[-window:]):.3f}, whole run {mean(flat):.3f}")
    prompts = checkpoint.load_state(runs['dynamic'])['config']['prompts_per_step']
    dropped = series(dynamic, 'dropped_groups')
    print(f"flat groups: dynamic sampling dropped {mean(dropped):.2f} groups per iteration of {prompts} prompts "
          f"(first {window} iterations {mean(dropped[:window]):.2f}, last {window} {mean(dropped[-window:]):.2f}), "
          f"flat share left {mean(series(dynamic, 'flat_groups')):.3f}")
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for rows, name, label in ((plain, 'dr_grpo', 'dynamic_sampling=False'), (dynamic, 'dynamic',
                                                                             'dynamic_sampling=True')):
        axes[0].plot(series(rows, 'iter'), smooth(series(rows, 'flat_groups'), window), color=COLORS[name],
                     label=label)
    axes[1].plot(series(dynamic, 'iter'), smooth(dropped, window), color=COLORS['dynamic'],
                 label='dynamic_sampling=True')
    axes[0].set(ylabel='share of the groups trained on', title=f'flat groups (mean of {window} iterations)')
    axes[1].set(ylabel='groups per iteration', title=f'flat groups dropped and resampled (mean of {window})')
    for ax in axes:
        ax.set(xlabel='iteration', ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    save(plt, fig, out, 'flat_groups.png')


# -----------------------------------------------------------------------------
# sampler.md

def fig_decode(plt, out, size):
    """Time of each decode step of model.generate, measured from outside: the model's decode method is wrapped on
    the instance (generate calls self.decode), so each call is timed and its rows counted. A random-weight model's
    softmax is near uniform, so with 1/32 of the vocabulary as eos ids each row ends with probability about 1/32 a
    step; the same generate without eos ids keeps every row to the end. Seeded: every repeat samples the same
    tokens, so each step's time is the median over the repeats."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16 + size['steps'], **size['decoder'])).eval()
    V = size['decoder']['vocab_size']
    prompts = torch.randint(V, (size['prompts'], 16), generator=torch.Generator().manual_seed(0)).tolist()
    decode, record = model.decode, []

    def timed(**step):  # engine.py passes the step's inputs by name
        t = time.perf_counter()
        result = decode(**step)
        record.append((time.perf_counter() - t, len(step['tok'])))  # eager on the CPU: done when it returns
        return result
    model.decode = timed
    cases = {'no row ends': None, 'rows end at eos': list(range(V - V // 32, V))}
    repeats = {name: [] for name in cases}
    for _ in range(size['repeats']):  # interleaved, so that both cases see the same spells of a shared machine
        for name, eos in cases.items():
            record.clear()
            t = time.perf_counter()
            _, mask, _ = model.generate(prompts, size['steps'], num_samples=8, eos_id=eos,
                                        generator=torch.Generator().manual_seed(1))
            repeats[name].append((time.perf_counter() - t, list(record), mask.sum(1).double().mean().item()))
    median = lambda xs: sorted(xs)[len(xs) // 2]
    runs = {}
    for name, reps in repeats.items():
        ms = [median([r[1][i][0] for r in reps]) * 1e3 for i in range(len(reps[0][1]))]
        rows = [n for _, n in reps[0][1]]
        runs[name] = median([r[0] for r in reps]), ms, rows
        print(f"decode: {name}: generate {runs[name][0]:.2f}s (median of {len(reps)}), {len(ms)} decode steps, "
              f"median step with {rows[0]} rows {median(ms[:8]):.2f} ms, last step with {rows[-1]} {ms[-1]:.2f} ms, "
              f"mean completion {reps[0][2]:.1f} tokens")
    del model.decode
    if plt is None:
        return
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, (total, ms, rows) in runs.items():
        axes[0].plot(rows, label=name)
        axes[1].plot(ms, label=f'{name}: generate {total:.2f} s')
    axes[0].set(ylabel='rows in the batch', title=f'{size["prompts"]} prompts x 8 samples, up to {size["steps"]} '
                f'new tokens, one thread')
    axes[1].set(xlabel='decode step', ylabel=f'ms per step (median of {size["repeats"]})', ylim=(0, None))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    save(plt, fig, out, 'decode_steps.png')


def fig_draw(plt, out, size):
    """sampling.sample's two-level draw against the exact softmax over 40 tokens: each token's share of many draws
    (uniforms drawn here), and its distance from the probability in binomial standard deviations."""
    g = torch.Generator().manual_seed(0)
    logits = 1.5 * torch.randn(40, generator=g)
    n = size['draws']
    tokens, logps = sample(logits.expand(n, -1), 1.0, None, None, torch.rand(n, 2, generator=g))
    p = torch.softmax(logits.double(), -1)
    freq = torch.bincount(tokens, minlength=40) / n
    z = (freq - p) / (p * (1 - p) / n).sqrt()
    gap = (logps - torch.log_softmax(logits, -1)[tokens]).abs().max().item()
    print(f"draw: {n} draws over 40 tokens: largest |share - probability| {z.abs().max().item():.2f} binomial "
          f"standard deviations, chi-square {(n * (freq - p) ** 2 / p).sum().item():.1f} on 39 degrees of freedom; "
          f"largest |reported log-prob - log_softmax| {gap:.1e}")
    if plt is None:
        return
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, height_ratios=(2, 1))
    axes[0].bar(range(40), p, color='lightgrey', edgecolor='grey', label='softmax probability')
    axes[0].plot(range(40), freq, 'o', ms=4, color='tab:blue', label=f'share of {n} draws')
    axes[0].set(ylabel='probability', title='the two-level inverse-CDF draw of sampling.py against the softmax')
    axes[0].legend(fontsize=9)
    axes[1].bar(range(40), z, color='tab:blue')
    axes[1].axhspan(-2, 2, color='grey', alpha=0.15, label='within 2 standard deviations')
    axes[1].set(xlabel='token id', ylabel='(share - p) / std')
    axes[1].legend(fontsize=8, loc='lower right')
    for ax in axes:
        ax.grid(axis='y', alpha=0.3)
    save(plt, fig, out, 'draw.png')


# -----------------------------------------------------------------------------

def main(check):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        if not check:
            sys.exit("error: make_figures.py needs matplotlib: pip install -r requirements-extra.txt")
        plt = None
        print("no matplotlib: computing the figures' data only")
    size = SIZES['check' if check else 'full']
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, 'figures') if check else os.path.join(ROOT, 'docs', 'figures')
        os.makedirs(out, exist_ok=True)
        t = time.time()
        runs = train_runs(work, size)
        print(f"runs: {size['iters']} iterations each, {time.time() - t:.0f}s")
        torch.set_num_threads(1)  # as each run had: the decode timing is steadier on one thread of a shared CPU
        fig_decode(plt, out, size)  # first, with the runs done: the timing wants the machine to itself
        fig_draw(plt, out, size)
        fig_normaliser_weights(plt, out)
        fig_length_bias(plt, out, runs, size['window'])
        fig_surrogates(plt, out)
        fig_kl_estimators(plt, out)
        fig_kl_placement(plt, out, runs['dr_grpo'])
        fig_on_policy(plt, out, runs['dr_grpo'])
        fig_advantages(plt, out)
        fig_flat_groups(plt, out, runs, size['window'])


if __name__ == '__main__':
    if sys.argv[1:] not in ([], ['--check']):
        sys.exit(__doc__)
    main(sys.argv[1:] == ['--check'])
