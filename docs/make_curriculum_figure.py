"""
docs/curriculum.md's figure from the runs' metrics.jsonl (the commands are on that page): held-out greedy
accuracy against the completions sampled, the share of flat groups in the batches trained on, and the
curriculum's pool.

$ python docs/make_curriculum_figure.py assets/curriculum_run.png out-curr/full/base out-curr/full/curriculum \
    out-curr/full/dynamic

draws the runs (each named by its folder) into the PNG and prints the numbers the page quotes. Needs matplotlib.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from scripts.plot import read, save  # noqa: E402

COLORS = dict(base='tab:blue', curriculum='tab:orange', dynamic='tab:green')


def curves(run):
    """The iterations' and evaluations' metrics, and the completions sampled before each
    iteration: P groups of G (the run's config.json), but where dynamic sampling dropped
    flat groups (every rank's), it sampled those and the batch's other groups."""
    train, evals = read(run)
    with open(os.path.join(run, 'config.json')) as f:
        config = json.load(f)
    P, G = config['prompts_per_step'], config['num_generations']
    drawn = [0]
    for r in train:
        groups = r['dropped_groups'] + P * (1 - r['flat_groups']) if r['dropped_groups'] else P
        drawn.append(drawn[-1] + G * round(groups))
    return train, evals, drawn


def smooth(values, window=10):
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def main(path, runs):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    # the pool's panel only where a run has a pool
    pooled = any('pool/active' in read(run)[0][-1] for run in runs)
    fig, axes = plt.subplots(1, 2 + pooled, figsize=(5 * (2 + pooled), 4))
    ax_acc, ax_flat, ax_pool = (*axes, None)[:3]
    seen = []
    for run in runs:
        # a run is named by its folder and the one above it (a seed's): a second run of a name is dashed
        parent, name = os.path.normpath(run).split(os.sep)[-2:]
        label, line = f'{name} ({parent})', '--' if name in seen else '-'
        seen.append(name)
        train, evals, drawn = curves(run)
        color = COLORS.get(name)
        x = [drawn[e['iter']] / 1e3 for e in evals]
        ax_acc.plot(x, [e['eval/greedy_acc'] for e in evals], 'o' + line, color=color, label=label)
        ax_flat.plot([r['iter'] for r in train], smooth([r['flat_groups'] for r in train]), line,
                     color=color, label=label)
        print(f"{label}: " + ", ".join(f"{d / 1e3:.0f}k {e['eval/greedy_acc']:.3f}"
                                      for d, e in zip([drawn[e['iter']] for e in evals], evals)))
        print(f"  flat share trained on: {sum(r['flat_groups'] for r in train) / len(train):.3f}, "
              f"completions sampled: {drawn[-1]}, seconds: {sum(r['dt'] for r in train):.0f}")
        if 'pool/active' in train[-1]:
            for key, shade in (('pool/active', 1.0), ('pool/easy', 0.6), ('pool/hard', 0.3)):
                ax_pool.plot([r['iter'] for r in train], [r[key] for r in train], line, color=color,
                             alpha=shade, label=f'{key[5:]} ({parent})')
            last = train[-1]
            print(f"  pool at the end: {last['pool/active']} active, {last['pool/easy']} too easy, "
                  f"{last['pool/hard']} too hard; revisits {sum(r['pool/revisits'] for r in train)}")
    ax_acc.set(xlabel='completions sampled (thousands)', ylabel='held-out greedy accuracy',
               title='accuracy against samples drawn')
    ax_flat.set(xlabel='iteration', ylabel='share of flat groups (10-iteration mean)',
                title='flat groups in the batch trained on')
    if pooled:
        ax_pool.set(xlabel='iteration', ylabel='prompts', title="the curriculum's pool")
    save(fig, axes, path, dpi=110)


if __name__ == '__main__':
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
