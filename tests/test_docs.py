"""
docs/ stays true to the code: every figure's data is recomputed by `python docs/make_figures.py --check` (toy
sizes, a temp dir, the committed PNGs untouched) and drawn under the names the pages link to; every relative link
in README.md and docs/ reaches a file; every PNG under docs/figures/ is shown by some page. README's two commands,
its count of tests, its log excerpt's lines and its tables' layout are those of the repository.
"""
import glob
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = os.path.join(ROOT, 'docs', 'figures')
PAGES = [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'),
                                                             recursive=True))
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')  # [text](target) and ![alt](target "title")


def links(page):
    """The relative link targets of a Markdown page, without their #anchors, as absolute paths."""
    with open(page) as f:
        text = re.sub(r'```.*?```', '', f.read(), flags=re.S)  # code blocks hold no links
    targets = [t.split('#')[0] for t in LINK.findall(text) if not re.match(r'[a-z]+:|#', t)]
    return [os.path.normpath(os.path.join(os.path.dirname(page), t)) for t in targets if t]


def digest(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_make_figures_check_computes_and_draws_every_figure():
    committed = {os.path.basename(p): digest(p) for p in glob.glob(os.path.join(FIGURES, '*.png'))}
    p = subprocess.run([sys.executable, 'docs/make_figures.py', '--check'], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, f"make_figures.py --check failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    drawn = re.findall(r'^drew (\S+)$', p.stdout, flags=re.M)
    if importlib.util.find_spec('matplotlib'):
        assert sorted(drawn) == sorted(committed), "the script draws what docs/figures/ holds, no more, no less"
    else:  # the data is computed all the same
        assert not drawn and 'no matplotlib' in p.stdout
    assert {os.path.basename(p): digest(p) for p in glob.glob(os.path.join(FIGURES, '*.png'))} == committed


def test_every_relative_link_reaches_a_file():
    assert len(PAGES) > 1, "no pages under docs/"
    missing = [(os.path.relpath(page, ROOT), os.path.relpath(t, ROOT)) for page in PAGES for t in links(page)
               if not os.path.exists(t)]
    assert not missing, f"links to nothing (page, target): {missing}"


def test_every_figure_is_shown_by_a_page():
    shown = {t for page in PAGES for t in links(page)}
    unshown = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(FIGURES, '*.png')) if p not in shown]
    assert glob.glob(os.path.join(FIGURES, '*.png')) and not unshown, f"figures no page shows: {unshown}"


def readme():
    with open(os.path.join(ROOT, 'README.md')) as f:
        return f.read()


def commands():
    """README's first code block: the default run's command and the tests', each a list of its `&&` parts."""
    block = re.search(r"```bash\n(.*?)```", readme(), flags=re.S).group(1)
    return [line.split(' && ') for line in block.splitlines() if not line.startswith('#')]


def excerpt():
    """The log README shows for the default run: its command, then its lines."""
    block = re.search(r"```\n(\$ .*?)```", readme(), flags=re.S).group(1)
    return block.splitlines()


def test_readme_s_commands_are_the_repository_s():
    """The files each command names exist; the run's command is the one its log excerpt and its config file show;
    the tests' command is the one CI runs."""
    run, tests = commands()
    for part in run + tests:
        words = part.split()
        named = [w for w, before in zip(words[1:], words) if before == '-r'] + [w for w in words if w.endswith('.py')]
        assert all(os.path.isfile(os.path.join(ROOT, f)) for f in named), part
    assert excerpt()[0] == f"$ {run[-1]}"
    assert f"$ {run[-1]} " in open(os.path.join(ROOT, 'config', 'dr_grpo.py')).read()
    assert open(os.path.join(ROOT, '.ci', 'run')).read().strip().splitlines()[-1] == tests[-1]


def test_readme_s_test_count_is_the_suite_s():
    said = int(re.search(r"\((\d+) tests, ", readme()).group(1))
    p = subprocess.run([sys.executable, '-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider'], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stdout[-3000:]
    # -q twice (pytest.ini's and this one): each file's count
    collected = sum(map(int, re.findall(r"^tests/\S+\.py: (\d+)$", p.stdout, flags=re.M)))
    assert said == collected, f"README says {said} tests, pytest collects {collected}: update README"


def shape(line):
    """A log line's format: its numbers as #, what the config changed as `...`."""
    return re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "#", re.sub(r"config: .*", "config: ...", line))


def test_readme_s_log_excerpt_is_what_the_run_prints(tmp_path):
    """The excerpt's command, shrunk to seconds (a tiny model, one iteration; 8 completions a prompt, as the
    default, for as many pass@k): each line of the excerpt has the format of a line it prints, in order."""
    command = excerpt()[0].split()
    assert command[:4] == ['$', 'torchrun', '--standalone', '--nproc_per_node=2'], command
    tiny = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--sft_iters=3', '--sft_target_acc=0', '--sft_batch_size=8',
            '--prompts_per_step=2', '--micro_batch_size=16', '--eval_size=4', '--max_iters=1', '--block_size=16',
            "--task_options={'digits': 1}", '--max_completion_length=4', '--peak_flops=1e12', f'--out_dir={tmp_path}']
    p = subprocess.run([sys.executable, *command[4:], *tiny], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stderr[-3000:]
    printed = iter([shape(line) for line in p.stdout.splitlines()])
    for line in excerpt()[1:]:
        # each in turn, after the one before (`in` on an iterator consumes it up to the match)
        assert line == '...' or shape(line) in printed, f"README's line has no counterpart in the run's:\n{line}"


def test_readme_s_tables_are_readme_table_s(tmp_path):
    """Each table under a scripts/readme_table.py line has the layout the script writes: written from a run's
    metrics.jsonl, the same header and row names, a number in each cell."""
    from scripts import readme_table
    marks = list(re.finditer(r"^(<!-- python -m scripts\.readme_table (\S+)((?: \d+)+) -->)\n((?:\|.*\n)+)",
                             readme(), flags=re.M))
    assert len(marks) >= 2
    for mark in marks:
        iters = [int(it) for it in mark.group(3).split()]
        out = tmp_path / mark.group(2)
        out.mkdir()
        warm = 'start of RL' in mark.group(4)  # a run with a warm start before RL, as the table says
        (out / 'config.json').write_text(json.dumps(dict(max_iters=iters[-1], sft_iters=int(warm))))
        lines = [dict(iter=it, **{'eval/greedy_acc': 0.5, 'eval/pass@1': 0.25, 'eval/pass@8': 0.75}) for it in iters]
        (out / 'metrics.jsonl').write_text(''.join(json.dumps(m) + '\n' for m in lines))
        title = mark.group(4).split('|')[1].strip()
        written = readme_table.table(str(out), iters, title)
        assert shape(written) == shape(mark.group(4).strip()), f"{mark.group(1)}:\n{written}"
