"""
README's tables of held-out accuracy, written from the runs that measured them. In README.md each
such table sits under a line naming its run and the iterations it shows,

    <!-- python -m scripts.readme_table out-dr_grpo 0 300 600 900 1200 -->

and is rewritten from that out_dir's metrics.jsonl: greedy accuracy, pass@1 and the largest pass@k
of the evaluations at those iterations, the first the start of RL, the last with the gain over it.

$ python -m scripts.readme_table                         # README.md's tables, rewritten in place
$ python -m scripts.readme_table out-dr_grpo 0 600 1200  # one table, printed
"""
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = re.compile(r"<!-- python -m scripts\.readme_table (\S+)((?: \d+)+) -->")


def evaluations(out_dir):
    """{iteration: its evaluation's metrics} of a run; a resumed run's repeat counts once, the
    last."""
    path = os.path.join(out_dir, 'metrics.jsonl')
    if not os.path.isfile(path):
        sys.exit(f"error: {path} not found; run the command that writes it first (README names it)")
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return {r['iter']: r for r in rows if 'eval/greedy_acc' in r}


def percent(x):
    return f"{100 * x:.1f}%".replace("100.0%", "100%")


def table(out_dir, iters, title='held-out'):
    """The Markdown table of the run in out_dir at iterations iters, its first cell `title`."""
    evals = evaluations(out_dir)
    missing = [it for it in iters if it not in evals]
    if missing:
        sys.exit(f"error: {out_dir} has no evaluation at iteration {missing[0]} "
                 f"(it has {', '.join(map(str, sorted(evals)))})")
    config_path = os.path.join(out_dir, 'config.json')
    config = json.load(open(config_path)) if os.path.isfile(config_path) else {}
    rows = [evals[it] for it in iters]
    last = max(k for k in rows[0] if k.startswith('eval/pass@'))
    head = ['start of RL' if config.get('sft_iters') else 'start', f'iteration {iters[1]}']
    head += [str(it) for it in iters[2:]]
    if iters[-1] == config.get('max_iters'):
        head[-1] += ' (end)'
    gain = 100 * (rows[-1]['eval/greedy_acc'] - rows[0]['eval/greedy_acc'])
    greedy = [percent(r['eval/greedy_acc']) for r in rows]
    greedy[-1] = f"**{greedy[-1]}** ({gain:+.1f} points)"
    lines = [[title] + head, ['---'] * (len(iters) + 1), ['greedy accuracy'] + greedy,
             ['pass@1 (T = 1)'] + [percent(r['eval/pass@1']) for r in rows],
             [last[5:]] + [percent(r[last]) for r in rows]]
    return '\n'.join('| ' + ' | '.join(cells) + ' |' for cells in lines)


def refresh(readme):
    """Rewrite every marked table of the file readme; returns how many."""
    with open(readme) as f:
        lines = f.read().split('\n')
    done = 0
    for i, line in enumerate(lines):
        mark = MARK.fullmatch(line)
        if not mark:
            continue
        end = i + 1
        while end < len(lines) and lines[end].startswith('|'):
            end += 1
        # the first cell says what is measured: kept as written
        title = lines[i + 1].split('|')[1].strip() if end > i + 1 else 'held-out'
        out_dir = os.path.join(ROOT, mark.group(1))
        new = table(out_dir, [int(it) for it in mark.group(2).split()], title).split('\n')
        lines[i + 1:end] = new
        done += 1
    with open(readme, 'w') as f:
        f.write('\n'.join(lines))
    return done


if __name__ == '__main__':
    if len(sys.argv) == 1:
        print(f"rewrote {refresh(os.path.join(ROOT, 'README.md'))} tables of README.md")
    elif len(sys.argv) < 4 or not all(a.isdigit() for a in sys.argv[2:]):
        sys.exit(__doc__)
    else:
        print(table(sys.argv[1], [int(a) for a in sys.argv[2:]]))
