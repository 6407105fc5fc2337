"""
Preemption (issue 16): SIGTERM, what SLURM and Kubernetes send before a kill, makes a run checkpoint at the next
iteration boundary, print the exact resume command and exit non-zero; that command finishes the run with the same
weights as a run never stopped. A second signal exits at once.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']
ARGS = ['train.py', '--dtype=float64', '--eval_interval=0', '--save_interval=1000', '--prompts_per_step=4',
        '--num_generations=4', "--task_options={'digits': 1}", '--max_completion_length=4', '--block_size=16',
        '--n_layer=1', '--n_head=2', '--n_embd=32', '--sft_iters=20', '--sft_target_acc=0', '--sft_batch_size=8',
        '--micro_batch_size=4', '--learning_rate=3e-3', '--num_iterations=2', '--max_iters=40', '--peak_flops=1e12']
# tests/ on the path for the multi-turn case's scripted environment (tests/multiturn_env.py)
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.path.join(ROOT, 'tests'))
TURNS = ['--env=multiturn_env:Echo', '--max_turns=3', '--max_completion_length=8']


def weights(out_dir):
    return load_file(os.path.join(out_dir, json.load(open(os.path.join(out_dir, 'latest'))), 'model.safetensors'))


def iterations(out_dir):
    path = os.path.join(out_dir, 'metrics.jsonl')
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def launch(command):
    """Run a torchrun command to its end; a failure shows the end of its stderr (torchrun's own exit code says
    nothing of the cause)."""
    p = subprocess.run(TORCHRUN + command, cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.mark.parametrize('turns', [[], TURNS], ids=['one turn', 'multi-turn'])
def test_sigterm_checkpoints_and_the_printed_command_resumes_bitwise(tmp_path, turns):
    straight = tmp_path / 'straight'
    launch(ARGS + turns + [f'--out_dir={straight}'])
    stopped = tmp_path / 'stopped'
    p = subprocess.Popen(TORCHRUN + ARGS + turns + [f'--out_dir={stopped}'], cwd=ROOT, env=ENV, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while iterations(stopped) < 3 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to both workers, as a cluster's kill does
    out, err = p.communicate(timeout=120)
    assert p.returncode != 0, out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith('stopped by SIGTERM before iteration'))
    it = int(lines[at].split('before iteration ')[1].split(':')[0])
    assert 3 <= it < 40, lines[at]  # mid-run, not at the end
    assert json.load(open(stopped / 'latest')) == f'ckpt-{it:06d}'
    command = shlex.split(lines[at + 1])
    assert command[:3] == ['torchrun', '--standalone', '--nproc_per_node=2'] and command[-1] == '--init_from=resume'
    launch(command[3:])
    a, b = weights(straight), weights(stopped)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bitwise
    assert json.load(open(stopped / 'latest')) == 'ckpt-000040'


def test_a_second_signal_exits_at_once_and_writes_nothing(tmp_path):
    out = tmp_path / 'out'
    p = subprocess.Popen([sys.executable, *ARGS, '--sft_iters=100000', f'--out_dir={out}'], cwd=ROOT, env=ENV,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(8)  # well into the (very long) warm start
    p.send_signal(signal.SIGTERM)  # the first asks for a checkpoint once the warm start is done...
    time.sleep(1.5)
    t = time.time()
    p.send_signal(signal.SIGTERM)  # ...the second, a second later or more, ends the process now
    p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and time.time() - t < 10
    assert not os.path.exists(out / 'latest') and not os.path.exists(out / 'warmstart')
