"""
Reward and accuracy curves from a run's metrics.jsonl (needs matplotlib, which training does not: it is in
requirements-extra.txt).

$ python scripts/plot.py out-dr_grpo               # writes out-dr_grpo/curves.png
$ python scripts/plot.py out-dr_grpo out-grpo      # several runs on the same axes, one colour each
With several reward functions, each one's mean is drawn beside the reward.
"""
import json
import os
import sys


def read(out_dir):
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f]
    # a resumed run appends: keep the last record of each (iteration, kind)
    train = {r['iter']: r for r in rows if 'reward' in r}
    evals = {r['iter']: r for r in rows if 'eval/greedy_acc' in r}
    return [train[k] for k in sorted(train)], [evals[k] for k in sorted(evals)]


def main(out_dirs):
    try:
        import matplotlib
        matplotlib.use('Agg')  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot.py needs matplotlib: pip install matplotlib (or pip install -r requirements-extra.txt)")
    for out_dir in out_dirs:
        if not os.path.isfile(os.path.join(out_dir, 'metrics.jsonl')):
            sys.exit(f"error: {out_dir} holds no metrics.jsonl; give the out_dir of a run "
                     f"(train.py's out_dir)")
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    for color, out_dir in zip(plt.rcParams['axes.prop_cycle'].by_key()['color'], out_dirs):
        train, evals = read(out_dir)
        name = os.path.basename(os.path.normpath(out_dir))
        ax_r.plot([r['iter'] for r in train], [r['reward'] for r in train], color=color, alpha=0.8, label=name)
        fns = [k for k in train[0] if k.startswith('reward/')]
        for style, key in zip((':', '-.', (0, (1, 4)), (0, (5, 1))), fns if len(fns) > 1 else ()):  # each function
            ax_r.plot([r['iter'] for r in train], [r[key] for r in train], linestyle=style, color=color,
                      label=f'{name} {key[7:]}')  # e.g. a judge's reward beside verifiers of the same property
        ax_a.plot([r['iter'] for r in evals], [r['eval/greedy_acc'] for r in evals], 'o-', color=color,
                  label=f'{name} greedy')
        ax_a.plot([r['iter'] for r in evals], [r['eval/pass@1'] for r in evals], '--', color=color,
                  label=f'{name} pass@1')
    ax_r.set(xlabel='iteration', ylabel='mean reward (train rollouts)', title='reward')
    ax_a.set(xlabel='iteration', ylabel='held-out accuracy', title='held-out accuracy', ylim=(0, 1))
    save(fig, (ax_r, ax_a), os.path.join(out_dirs[0], 'curves.png'), dpi=120)


def save(fig, axes, path, dpi):
    """Each panel's grid and legend, then the figure written to path (plot_distill.py and
    docs/make_curriculum_figure.py end their figures with it too)."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}")


if __name__ == '__main__':
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
