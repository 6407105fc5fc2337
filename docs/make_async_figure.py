"""
The measurement of docs/async.md (issue 57): the default task at max_staleness K = 0, 1, 4,
16, each K > 0 with the decoupled correction and without ('none'), one run after another
from one warm start; then assets/async_run.png and the numbers the page quotes, from each
run's metrics.jsonl.

$ python docs/make_async_figure.py          # the runs out-async/ lacks, the figure, the table
$ python docs/make_async_figure.py --check  # the same code at toy sizes, in a temp dir

A run whose metrics.jsonl holds its last evaluation is not run again, so a stopped
measurement goes on where it stopped. Each run is the default run's first `iters` iterations
(its learning rate is constant), evaluated every 100 on `eval_size` held-out prompts;
OMP_NUM_THREADS=1, since the machine it was made on is shared.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ['k0-none', 'k16-none', 'k16-decoupled', 'k4-none', 'k4-decoupled', 'k1-none',
        'k1-decoupled']
SIZES = {
    'full': dict(iters=400, runs=RUNS, train=['--eval_size=200'], window=20),
    'check': dict(iters=4, runs=['k0-none', 'k2-none', 'k2-decoupled'], window=2,
                  train=['--eval_size=4', '--eval_interval=2', '--n_layer=1', '--n_head=2',
                         '--n_embd=32', '--sft_iters=3', '--sft_batch_size=8',
                         '--prompts_per_step=4', '--num_generations=4',
                         '--micro_batch_size=4', '--peak_flops=1e12']),
}


def settings(run):
    """'k16-none' -> ['--max_staleness=16', '--stale_correction=none']"""
    k, correction = run.split('-')
    return [f'--max_staleness={k[1:]}', f'--stale_correction={correction}']


def metrics(out_dir):
    """(iteration rows, evaluation rows) of a run's metrics.jsonl, [] for a run not made yet."""
    path = os.path.join(out_dir, 'metrics.jsonl')
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    evals = [r for r in rows if 'eval/greedy_acc' in r]
    return [r for r in rows if 'reward' in r], evals


def train(work, size):
    """Each run of size in work/<run>/, one after another, from one warm start (copied into
    each: train.py reuses a warm start whose settings match). A run already whole is kept."""
    env = dict(os.environ, OMP_NUM_THREADS='1')
    args = [sys.executable, 'train.py', 'config/dr_grpo.py', '--save_interval=0', *size['train']]
    warm = os.path.join(work, 'warm')
    if not os.path.exists(os.path.join(warm, 'warmstart', 'warmstart.json')):
        subprocess.run(args + ['--max_iters=0', '--eval_interval=0', f'--out_dir={warm}'], cwd=ROOT,
                       env=env, check=True, stdout=subprocess.DEVNULL)
    for run in size['runs']:
        out = os.path.join(work, run)
        evals = metrics(out)[1]
        if evals and evals[-1]['iter'] == size['iters']:
            continue
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(os.path.join(warm, 'warmstart'), os.path.join(out, 'warmstart'))
        print(f"running {run}", flush=True)
        with open(os.path.join(work, f'{run}.log'), 'w') as log:
            flags = settings(run) + [f'--max_iters={size["iters"]}', f'--out_dir={out}']
            subprocess.run(args + flags, cwd=ROOT, env=env, check=True, stdout=log,
                           stderr=subprocess.STDOUT)


def mean(values):
    return sum(values) / len(values) if values else float('nan')


def table(work, size):
    """The numbers docs/async.md quotes, a line a run; returns them by run."""
    out = {}
    print("run            | held-out greedy acc by eval | reward, last 50 | dt s | generate s | "
          "update s | sampler kl, last 50 | clipped")
    for run in size['runs']:
        rows, evals = metrics(os.path.join(work, run))
        last = rows[-50:]
        out[run] = dict(
            acc=[round(e['eval/greedy_acc'], 3) for e in evals],
            reward=mean([r['reward'] for r in last]), dt=mean([r['dt'] for r in rows]),
            generate=mean([r['time/generate'] for r in rows]),
            update=mean([r['time/update'] for r in rows]),
            kl=mean([r['sampler/kl'] for r in last]),
            clipped=mean([r.get('stale/clipped', 0.0) for r in last]))
        n = out[run]
        print(f"{run:14s} | {n['acc']} | {n['reward']:.3f} | {n['dt']:.2f} | {n['generate']:.2f} | "
              f"{n['update']:.2f} | {n['kl']:.2e} | {n['clipped']:.3f}")
    return out


def smooth(values, window):
    return [mean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def draw(work, size, path):
    """Held-out accuracy, the train reward (a moving mean), the sampler-trainer KL and the
    time of an iteration's phases: a colour per K, solid with the correction, dashed without."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ((acc, reward), (kl, time)) = plt.subplots(2, 2, figsize=(11, 7.5))
    colors = {'k0': 'black', 'k1': 'tab:blue', 'k2': 'tab:blue', 'k4': 'tab:orange',
              'k16': 'tab:red'}
    for i, run in enumerate(size['runs']):
        rows, evals = metrics(os.path.join(work, run))
        k, correction = run.split('-')
        bare = correction == 'none' and k != 'k0'
        style = dict(color=colors[k], linestyle='--' if bare else '-',
                     label='K = 0 (sync)' if k == 'k0' else f"K = {k[1:]}, {correction}")
        acc.plot([e['iter'] for e in evals], [e['eval/greedy_acc'] for e in evals],
                 marker='o', **style)
        its = [r['iter'] for r in rows]
        reward.plot(its, smooth([r['reward'] for r in rows], size['window']), **style)
        kl.plot(its, smooth([r['sampler/kl'] for r in rows], size['window']), **style)
        generate = mean([r['time/generate'] for r in rows])
        update = mean([r['time/update'] for r in rows])
        rest = mean([r['dt'] for r in rows]) - generate - update
        time.bar(i, generate, color=colors[k], alpha=0.9, hatch='//' if bare else None)
        time.bar(i, update, bottom=generate, color='0.6')
        time.bar(i, rest, bottom=generate + update, color='0.85')
    acc.set(xlabel='iteration', ylabel='held-out greedy accuracy', title='held-out accuracy')
    reward.set(xlabel='iteration', ylabel=f"train reward, mean of {size['window']}",
               title='train reward')
    kl.set(xlabel='iteration', ylabel='sampler/kl (k3)', yscale='log',
           title="KL(sampler's policy || the trained one)")
    time.set_xticks(range(len(size['runs'])), size['runs'], rotation=45, fontsize=8)
    time.set(ylabel='seconds an iteration', title='generate (colour), update (grey), rest')
    for ax in (acc, reward, kl, time):
        ax.grid(alpha=0.3)
    acc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(check):
    size = SIZES['check' if check else 'full']
    work = tempfile.mkdtemp() if check else os.path.join(ROOT, 'out-async')
    train(work, size)
    table(work, size)
    try:
        import matplotlib  # noqa: F401 (only to know it is there)
    except ImportError:
        print("no matplotlib: the figure is not drawn (pip install -r requirements-extra.txt)")
        return
    draw(work, size, os.path.join(work if check else os.path.join(ROOT, 'assets'), 'async_run.png'))


if __name__ == '__main__':
    main(check='--check' in sys.argv[1:])
