"""
Safe under faults (issue 5): a non-finite step is skipped and counted, too many in a row stop the run with the last
good checkpoint intact, and SIGKILL at random moments (mid-checkpoint included) never leaves out_dir without a
complete, loadable latest checkpoint.
"""
import functools
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from lib import checkpoint
import loss
from model import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--sft_iters=5', '--sft_batch_size=8', '--prompts_per_step=4',
        '--num_generations=4', '--micro_batch_size=4', '--eval_interval=0', '--save_interval=1',
        "--task_options={'digits': 1}", '--max_completion_length=4', '--block_size=16', '--max_bad_steps=2',
        '--peak_flops=1e12']


def train_in_process(args):
    """Run train.py in this process (so a test can patch what it imports), as `python train.py ARGS`."""
    argv = sys.argv
    sys.argv = ['train.py', *TINY, *args]
    try:
        runpy.run_path(os.path.join(ROOT, 'train.py'), run_name='__main__')
    finally:
        sys.argv = argv


def nan_on(calls):
    """A grpo_loss that returns NaN on the given call numbers (1-based), the real loss otherwise."""
    real, count = loss.grpo_loss, [0]

    @functools.wraps(real)  # its signature is configurator.loss_settings()'s
    def grpo_loss(*args, **kwargs):
        out, stats = real(*args, **kwargs)
        count[0] += 1
        return (out * float('nan'), stats) if count[0] in calls else (out, stats)
    return grpo_loss


def test_a_nan_step_is_skipped_and_counted(tmp_path, monkeypatch):
    # 16 completions in micro-batches of 4: calls 5-8 are iteration 1's micro-batches; one NaN spoils its step
    monkeypatch.setattr(loss, 'grpo_loss', nan_on({6}))
    train_in_process(['--max_iters=3', f'--out_dir={tmp_path}'])
    rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    assert [r['bad_steps'] for r in rows] == [0, 1, 0]
    assert all(r['grad_norm'] == r['grad_norm'] for r in rows if r['iter'] != 1)  # finite elsewhere
    state = checkpoint.load_state(str(tmp_path))
    assert state['iter'] == 3 and state['step'] == 2  # three iterations, one optimizer step skipped


def test_too_many_bad_steps_stop_with_the_last_checkpoint_intact(tmp_path, monkeypatch):
    train_in_process(['--max_iters=2', f'--out_dir={tmp_path}'])
    latest = (tmp_path / 'latest').read_text()
    files = {f: (tmp_path / json.loads(latest) / f).read_bytes() for f in ('model.safetensors', 'trainer.json')}
    monkeypatch.setattr(loss, 'grpo_loss', nan_on(set(range(1, 1000))))
    with pytest.raises(SystemExit) as e:
        train_in_process(['--max_iters=6', '--init_from=resume', f'--out_dir={tmp_path}'])
    assert "2 optimizer steps in a row had a non-finite loss or gradient (iteration 3)" in str(e.value)
    assert "the last good checkpoint" in str(e.value)
    assert (tmp_path / 'latest').read_text() == latest  # iteration 2's checkpoint is still the latest, unchanged
    assert all((tmp_path / json.loads(latest) / f).read_bytes() == b for f, b in files.items())


def assert_loadable(out_dir):
    """The latest checkpoint is complete: model, optimizer state, trainer state."""
    state = checkpoint.load_state(out_dir)
    GPT.from_pretrained(state['dir'])
    load_file(os.path.join(state['dir'], 'optimizer.safetensors'))
    json.load(open(os.path.join(state['dir'], 'optimizer.json')))
    return state['iter']


def test_sigkill_at_random_moments_never_loses_the_checkpoint(tmp_path):
    rng = random.Random(0)
    env = dict(os.environ, OMP_NUM_THREADS='1')
    out, progress = str(tmp_path), []
    for kill in range(5):
        resume = ['--init_from=resume'] if os.path.exists(tmp_path / 'latest') else []
        p = subprocess.Popen([sys.executable, 'train.py', *TINY, '--max_iters=100000', f'--out_dir={out}', *resume],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        latest = lambda: (tmp_path / 'latest').read_text() if os.path.exists(tmp_path / 'latest') else None
        before, deadline = latest(), time.time() + 60
        while latest() == before and time.time() < deadline:  # this run's first checkpoint, then a random moment
            time.sleep(0.02)
        time.sleep(rng.uniform(0.05, 1.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        progress.append(assert_loadable(out))
    assert progress == sorted(progress) and progress[-1] > progress[0]  # each resume went on from the last
    leftovers = [f for f in os.listdir(out) if f.startswith('ckpt-')]
    assert len(leftovers) <= 2  # the latest, and at most one a kill caught before it could be removed
    p = subprocess.run([sys.executable, 'train.py', *TINY, f'--max_iters={progress[-1] + 2}', '--init_from=resume',
                        f'--out_dir={out}'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert assert_loadable(out) == progress[-1] + 2
