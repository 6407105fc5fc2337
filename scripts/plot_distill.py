"""
docs/distillation.md's figures, of several runs: held-out greedy accuracy against iterations
and against the training's wall time, and the reverse KL to the teacher per token (needs
matplotlib, as scripts/plot.py does).

$ python scripts/plot_distill.py assets/distill_toy.png reward=out-reward teacher=out-distill

Each NAME=OUT_DIR is a run of train.py (its metrics.jsonl). The wall time is the sum of the
iterations' `dt` (sampling, the teacher's forward, the update) up to each evaluation: the
evaluations' own time is left out, as it is the same for every run.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.plot import read, save  # noqa: E402


def curves(out_dir):
    """(iterations, minutes of training, greedy accuracy) at each evaluation; (iteration,
    teacher kl) of the iterations that logged one, averaged over tenths of the run."""
    train, evals = read(out_dir)
    minutes, total = {0: 0.0}, 0.0
    for r in train:
        total += r['dt'] / 60
        minutes[r['iter'] + 1] = total
    its = [e['iter'] for e in evals]
    acc = [e['eval/greedy_acc'] for e in evals]
    kl = [(r['iter'], r['teacher/kl']) for r in train if 'teacher/kl' in r]
    # a sample of the KL each iteration: the mean of each tenth of the run, at its middle
    n = max(1, len(kl) // 10)
    blocks = [kl[k:k + n] for k in range(0, len(kl), n)]
    kl = [(sum(i for i, _ in b) / len(b), sum(v for _, v in b) / len(b)) for b in blocks]
    return (its, [minutes[i] for i in its], acc), kl


def main(path, runs):
    try:
        import matplotlib
        matplotlib.use('Agg')  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot_distill.py needs matplotlib: pip install matplotlib")
    named = [run.partition('=') for run in runs]
    for name, eq, out_dir in named:
        if not eq or not os.path.isfile(os.path.join(out_dir, 'metrics.jsonl')):
            sys.exit(f"error: '{name}{eq}{out_dir}' is not NAME=OUT_DIR of a run "
                     f"(a train.py out_dir, with its metrics.jsonl)")
    fig, (by_iter, by_time, by_kl) = plt.subplots(1, 3, figsize=(15, 4))
    for name, _, out_dir in named:
        (its, minutes, acc), kl = curves(out_dir)
        line, = by_iter.plot(its, acc, 'o-', label=name)
        by_time.plot(minutes, acc, 'o-', color=line.get_color(), label=name)
        if kl:
            by_kl.plot(*zip(*kl), color=line.get_color(), alpha=0.8, label=name)
    by_iter.set(xlabel='iteration', ylabel='held-out greedy accuracy', ylim=(0, 1))
    by_time.set(xlabel='minutes of training (evaluations left out)',
                ylabel='held-out greedy accuracy', ylim=(0, 1))
    by_kl.set(xlabel='iteration', ylabel='nats per token',
              title='teacher kl, the mean of each tenth of the run')
    save(fig, (by_iter, by_time, by_kl), path, dpi=110)


if __name__ == '__main__':
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
