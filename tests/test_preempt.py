"""
Preemption (issues 16 and 55): SIGTERM, what SLURM and Kubernetes send before a kill, makes a run checkpoint the state
before the iteration it is in, print the exact resume command and exit non-zero, within seconds wherever it is (the
warm start, an evaluation, a generate, the update); that command finishes the run with the same weights as a run
never stopped. A second signal exits at once, but lets a checkpoint being written finish first.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import loss
from lib import checkpoint, parallelism
from model import GPT, GPTConfig
from test_faults import train_in_process

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


# the stream's rollouts in flight (issue 57): saved or drawn again, the same run
@pytest.mark.parametrize('turns', [[], TURNS, ['--max_staleness=2']],
                         ids=['one turn', 'multi-turn', 'two versions behind'])
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


def start(args, out_dir, **popen):
    """python train.py ARGS in the background, its output in pipes."""
    return subprocess.Popen([sys.executable, *ARGS, *args, f'--out_dir={out_dir}'], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def wait_for(p, text):
    """Read p's stdout until a line holds text; returns what it read."""
    seen = ''
    while text not in seen:
        line = p.stdout.readline()
        assert line, f"the run ended before printing {text!r}:\n{seen}{p.stderr.read()[-3000:]}"
        seen += line
    return seen


def stopped_within(p, seconds):
    """SIGTERM to p; its exit code and output once it has exited, which must be within `seconds`."""
    p.send_signal(signal.SIGTERM)
    try:
        out, err = p.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"still running {seconds}s after the signal:\n{out[-2000:]}{err[-2000:]}") from None
    return p.returncode, out, err


def test_a_stop_in_the_warm_start_is_acted_on_within_seconds(tmp_path):
    out = tmp_path / 'out'
    p = start(['--sft_iters=100000', '--progress_interval=0'], out)
    wait_for(p, 'warm start: 20/100000 steps')
    code, stdout, err = stopped_within(p, 10)
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM in the warm start: nothing saved; the same command starts again" in stdout
    assert "SIGTERM: stopping" in err  # said at once
    assert not os.path.exists(out / 'latest') and not os.path.exists(out / 'warmstart')


def test_a_stop_in_an_evaluation_is_acted_on_within_seconds_and_not_logged(tmp_path):
    """An evaluation of 1,000 prompts of 64 tokens, a scratch model's (it seldom ends early): stopped after its
    first chunk, it saves the state before iteration 0 and logs no evaluation, which resume does again."""
    out = tmp_path / 'out'
    p = start(['--sft_iters=0', '--eval_interval=10', '--eval_size=1000', '--prompts_per_step=32', "--task_options={}",
               '--micro_batch_size=32', '--max_completion_length=64', '--block_size=80', '--progress_interval=0'], out)
    wait_for(p, 'eval 0, greedy: 32/')
    code, stdout, _ = stopped_within(p, 10)
    assert code == 128 + signal.SIGTERM and 'stopped by SIGTERM before iteration 0' in stdout
    assert json.load(open(out / 'latest')) == 'ckpt-000000' and iterations(out) == 0  # nothing logged
    assert 'eval 0, sampled: 992/' not in stdout  # the evaluation was cut short


def test_a_stop_in_the_update_saves_the_state_before_it(tmp_path, monkeypatch):
    """A signal during iteration 1's update, before its optimizer step: the run saves the state before iteration 1,
    bit for bit the end of a run of one iteration, and exits."""
    monkeypatch.setitem(parallelism.asked, 'signal', 0)  # set below, put back after
    real, calls = loss.grpo_loss, [0]

    def grpo_loss(*args, **kwargs):  # 16 completions in micro-batches of 4: call 5 is iteration 1's first
        calls[0] += 1
        if calls[0] == 5:
            parallelism.asked.update(signal=signal.SIGTERM, time=time.time())
        return real(*args, **kwargs)
    args = ['--save_interval=0', '--eval_interval=0', '--max_iters=5']
    train_in_process(args[:2] + ['--max_iters=1', f'--out_dir={tmp_path}/one'])
    monkeypatch.setattr(loss, 'grpo_loss', grpo_loss)
    with pytest.raises(SystemExit) as e:
        train_in_process(args + [f'--out_dir={tmp_path}/stopped'])
    assert e.value.code == 128 + signal.SIGTERM and calls[0] == 5  # not a micro-batch more, nor the step
    assert json.load(open(tmp_path / 'stopped' / 'latest')) == 'ckpt-000001'
    a, b = weights(tmp_path / 'one'), weights(tmp_path / 'stopped')
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_ends_a_generate_early(monkeypatch):
    """generate, the engine's and the plain one, ends at its first check once a stop signal came (the run drops
    what it sampled): a pass or two through the model, not fifty."""
    model = GPT(GPTConfig(block_size=64, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).eval()
    passes, hidden = [], model.hidden

    def counted(*args, **kwargs):
        passes.append(1)
        return hidden(*args, **kwargs)
    monkeypatch.setattr(model, 'hidden', counted, raising=False)
    for plain in (False, True):
        for sig in (0, signal.SIGINT):
            monkeypatch.setitem(parallelism.asked, 'signal', sig)
            passes.clear()
            model.generate([[1, 2, 3], [4]], 50, num_samples=2, plain=plain,
                           generator=torch.Generator().manual_seed(0))
            assert len(passes) <= 2 if sig else len(passes) >= 49, (plain, sig, len(passes))


# a checkpoint write held up in its middle (trainer.json, the last file before the rename), announced on stdout
SLOW_SAVE = """
import runpy, sys, time
from lib import checkpoint
real = checkpoint.write_json
def write_json(path, obj):
    if path.endswith('trainer.json'):
        print('writing the checkpoint', flush=True)
        time.sleep(4)
    real(path, obj)
checkpoint.write_json = write_json
sys.argv = sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
"""


def test_a_second_signal_while_a_checkpoint_is_written_exits_once_it_is_whole(tmp_path):
    out = tmp_path / 'out'
    p = subprocess.Popen([sys.executable, '-c', SLOW_SAVE, *ARGS, '--save_interval=1', '--sft_iters=0',
                          f'--out_dir={out}'], cwd=ROOT, env=dict(ENV, PYTHONPATH=ROOT), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(p, 'writing the checkpoint')
    p.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # a repeat within a second is the first one delivered twice
    p.send_signal(signal.SIGTERM)
    out_text, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    state = checkpoint.load_state(str(out))  # iteration 1's checkpoint, whole, and then nothing more
    assert state['iter'] == 1 and iterations(out) == 1
    GPT.from_pretrained(state['dir'])
    load_file(os.path.join(state['dir'], 'optimizer.safetensors'))
    assert 'exiting once the checkpoint being written is complete' in err


SLEEPY_REWARD = """
import time
def sleepy(prompts, completions, **kwargs):
    if len(completions) > 4:  # a rollout's, not the check at start's
        print('scoring', flush=True)
        time.sleep(60)
    return [0.0] * len(completions)
"""


def test_a_second_signal_exits_at_once_and_writes_nothing(tmp_path):
    """Where nothing can stop early (a user's reward function that takes its time), a second signal, a second
    after the first or later, ends the process at once."""
    (tmp_path / 'sleepy.py').write_text(SLEEPY_REWARD)
    out = tmp_path / 'out'
    p = subprocess.Popen([sys.executable, *ARGS, '--sft_iters=0', "--reward_funcs=('sleepy:sleepy',)",
                          f'--out_dir={out}'], cwd=ROOT, env=dict(ENV, PYTHONPATH=str(tmp_path)), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(p, 'scoring')
    p.send_signal(signal.SIGTERM)  # the first asks for a checkpoint once the rollout is done...
    time.sleep(1.5)
    code, _, _ = stopped_within(p, 10)  # ...the second ends the process now
    assert code == 128 + signal.SIGTERM
    assert not os.path.exists(out / 'latest')
