"""
docs/ stays true to the code: every figure's data is recomputed by `python docs/make_figures.py --check` (toy
sizes, a temp dir, the committed PNGs untouched) and drawn under the names the pages link to; every relative link
in README.md and docs/ reaches a file; every PNG under docs/figures/ is shown by some page.
"""
import glob
import hashlib
import importlib.util
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
