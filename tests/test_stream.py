"""
Training up to K policy versions behind (issue 57, items 2 and 3; lib/stream.py): the schedule (iteration it trains
on the groups the policy sampled before iteration it - K, none dropped, none older), the K = 0 run is today's,
bitwise, a stale run resumes bitwise, and each rollout is the one rollout.py draws for its iteration. The stale
objectives themselves are checked against a float64 brute force in test_loss.py.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from safetensors.torch import load_file

import loss
from rollout import prompt_seed
from lib import parallelism, stream
from test_exact import BASE, LAYOUT_METRICS, ROOT, TORCHRUN, launch, max_diff, metric_lines, weights
from test_faults import train_in_process

TINY = BASE + ['--max_iters=6', '--num_iterations=2', '--loss_type=grpo', "--reward_funcs=('exact_match', 'overlong')"]


def fake_rollouts(log):
    """A sample function that records which iteration it drew and with which weights (log['weights'], what
    the trainer bumps after each of its iterations)."""
    def sample(it):
        log['drawn'].append(it)
        group = dict(prompt=[1, 2], tokens=torch.tensor([[it, log['weights']]]), rewards=torch.zeros(1))
        return [group], dict(time=dict(generate=0.5, reward=0.25), dropped_groups=it % 3)
    return sample


@pytest.mark.parametrize('K', [1, 2, 4])
def test_the_schedule_trains_k_versions_behind_and_drops_nothing(K):
    log = dict(drawn=[], weights=0)
    ahead = stream.Stream(fake_rollouts(log), max_staleness=K, seed_of=lambda j: prompt_seed(1, j, 0))
    for it in range(10):
        groups, info = ahead.take(it)
        drawn_it, sampled_by = groups[0]['tokens'][0].tolist()
        # iteration it's own groups, sampled by the weights as they were before iteration it - K
        assert drawn_it == it and sampled_by == groups[0]['version'] == max(0, it - K)
        assert info['stale'] == {'stale/mean': min(it, K), 'stale/max': min(it, K)}
        log['weights'] += 1
    # each iteration drawn once, in order, never more than K ahead of the one trained on
    assert log['drawn'] == list(range(10 + K))


def test_a_checkpoint_keeps_what_older_versions_sampled():
    """tensors(it) holds the rollouts in flight that versions before it sampled, and they come back as they were;
    the ones the saved weights sampled are drawn again, the same."""
    log = dict(drawn=[], weights=0)
    ahead = stream.Stream(fake_rollouts(log), max_staleness=3, seed_of=lambda j: prompt_seed(1, j, 0))
    for it in range(5):
        ahead.take(it)
        log['weights'] += 1
    saved = ahead.tensors(5)
    assert sorted({int(k.split('.')[0]) for k in saved}) == [5, 6, 7]  # 8 was drawn by version 4: not kept
    again = stream.Stream(fake_rollouts(dict(drawn=[], weights=5)), max_staleness=3, seed_of=lambda j: prompt_seed(1, j, 0),
                          saved=saved)
    for j in (5, 6, 7):
        (a,), info_a = ahead.rollouts[j]
        (b,), info_b = again.rollouts[j]
        assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
        assert info_a == info_b
    with pytest.raises(ValueError, match='resume with max_staleness >= 3'):
        stream.Stream(None, max_staleness=2, seed_of=lambda j: prompt_seed(1, j, 0), saved=saved)


def stale_keys(rows):
    return [{k: v for k, v in r.items() if not k.startswith('stale/')} for r in rows]


def test_k0_is_todays_run_bitwise(policy, tmp_path, monkeypatch):
    """The default run never touches the stream (every entry point raises here), and max_staleness=0 with any
    stale_correction is that run, bitwise: metrics and checkpoint."""
    def untouched(*args, **kwargs):
        raise AssertionError("the stream was used with max_staleness=0")
    for name in ('Stream', 'start', 'line', 'rollouts_of'):
        monkeypatch.setattr(stream, name, untouched)
    monkeypatch.setattr(loss, 'stale_objective', untouched)
    args = BASE + ['--max_iters=4', '--num_iterations=2', f'--init_from={policy}', '--sft_iters=0']
    train_in_process(args + [f'--out_dir={tmp_path}/absent'])
    train_in_process(args + ['--max_staleness=0', '--stale_correction=tis', f'--out_dir={tmp_path}/k0'])
    absent, k0 = metric_lines(tmp_path / 'absent'), metric_lines(tmp_path / 'k0')
    assert len(absent) == 4 and absent == k0 and not any(k.startswith('stale') for k in absent[0])
    for file in ('model.safetensors', 'optimizer.safetensors'):
        assert max_diff(weights(tmp_path / 'absent', file), weights(tmp_path / 'k0', file)) == 0
    assert not any(f.startswith('stream') for f in os.listdir(tmp_path / 'k0' / 'ckpt-000004'))


def test_each_rollout_is_todays_for_its_iteration(policy, tmp_path):
    """With a learning rate far below float64's rounding of the weights every version is the same policy, so
    K = 2 must sample exactly today's rollouts and learn exactly today's (no correction: the same loss): every
    metric but the staleness is the K = 0 run's."""
    args = TINY + [f'--init_from={policy}', '--learning_rate=1e-300', '--stale_correction=none']
    launch([args + [f'--out_dir={tmp_path}/k0'], args + ['--max_staleness=2', f'--out_dir={tmp_path}/k2']],
           tmp_path)
    k0, k2 = metric_lines(tmp_path / 'k0'), metric_lines(tmp_path / 'k2')
    assert [r['stale/mean'] for r in k2] == [r['stale/max'] for r in k2] == [0, 1, 2, 2, 2, 2]
    assert k0 == stale_keys(k2) and len({r['reward'] for r in k0}) > 1


@pytest.mark.parametrize('correction', ['decoupled', 'tis', 'none'])
def test_stale_run_resumes_bitwise(policy, tmp_path, correction):
    """6 iterations at K = 2 straight = 3, then resumed to 6: the rollouts in flight come back from the checkpoint
    (sampled by older versions) or are drawn again (by the saved one): metrics, weights and optimizer state."""
    # a tight bound on the weights, so that some are clipped in these few iterations
    args = TINY + ['--max_staleness=2', f'--stale_correction={correction}', '--sampler_correction_clip_max=1.05']
    launch([args + [f'--init_from={policy}', f'--out_dir={tmp_path}/straight'],
            args + [f'--init_from={policy}', '--max_iters=3', f'--out_dir={tmp_path}/resumed'],
            args + ['--init_from=resume', f'--out_dir={tmp_path}/resumed']], tmp_path)
    for file in ('model.safetensors', 'optimizer.safetensors'):
        assert max_diff(weights(tmp_path / 'straight', file), weights(tmp_path / 'resumed', file)) == 0
    straight, resumed = metric_lines(tmp_path / 'straight'), metric_lines(tmp_path / 'resumed')
    assert [r for r in straight if r['iter'] >= 3] == [r for r in resumed if r['iter'] >= 3]
    assert [r['stale/max'] for r in straight] == [0, 1, 2, 2, 2, 2]
    # Stale groups are off-policy: the gap between the sampler and the policy before the update grows, and the
    # correction's weights of it get clipped. Without a correction the old log-probs are the sampler's own.
    last = straight[-1]
    if correction == 'none':
        assert last['sampler/kl'] == 0 and 'stale/clipped' not in last
    else:
        assert last['sampler/kl'] > 1e-6 and last['stale/clipped'] > 0, last


def test_a_stop_while_sampling_ahead_resumes_bitwise(policy, tmp_path, monkeypatch):
    """SIGTERM while iteration 3 samples iteration 5's groups (cut short): the checkpoint before iteration 3 keeps
    iterations 3 and 4's groups, not the cut ones, and the run resumed from it is the run never stopped."""
    args = TINY + ['--max_staleness=2', f'--init_from={policy}', '--save_interval=0']
    train_in_process(args + [f'--out_dir={tmp_path}/straight'])
    monkeypatch.setitem(parallelism.asked, 'signal', 0)
    real = stream.Stream.take

    def take(self, it):
        if it == 3:
            parallelism.asked.update(signal=signal.SIGTERM, time=time.time())
        return real(self, it)
    monkeypatch.setattr(stream.Stream, 'take', take)
    with pytest.raises(SystemExit) as e:
        train_in_process(args + [f'--out_dir={tmp_path}/stopped'])
    assert e.value.code == 128 + signal.SIGTERM
    assert json.load(open(tmp_path / 'stopped' / 'latest')) == 'ckpt-000003'
    monkeypatch.setattr(stream.Stream, 'take', real)
    monkeypatch.setitem(parallelism.asked, 'signal', 0)
    train_in_process(args + ['--init_from=resume', f'--out_dir={tmp_path}/stopped'])
    assert max_diff(weights(tmp_path / 'straight'), weights(tmp_path / 'stopped')) == 0
    assert metric_lines(tmp_path / 'straight') == metric_lines(tmp_path / 'stopped')


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo on Linux')
def test_two_ranks_each_with_its_queue_resume_bitwise(policy, tmp_path):
    """Under torchrun each rank streams its own prompts; a stop and resume on 2 ranks is the run never stopped,
    and resuming on another number of ranks is refused in one line."""
    args = TINY + ['--max_staleness=2', '--max_iters=4']
    two = TORCHRUN + ['--standalone', '--nproc_per_node=2']
    launch([args + [f'--init_from={policy}', f'--out_dir={tmp_path}/straight'],
            args + [f'--init_from={policy}', '--max_iters=2', f'--out_dir={tmp_path}/resumed'],
            args + ['--init_from=resume', f'--out_dir={tmp_path}/resumed']], tmp_path, two)
    assert max_diff(weights(tmp_path / 'straight'), weights(tmp_path / 'resumed')) == 0
    assert metric_lines(tmp_path / 'straight')[2:] == metric_lines(tmp_path / 'resumed')[2:]
    p = launch([args + ['--init_from=resume', '--max_iters=6', f'--out_dir={tmp_path}/resumed']], tmp_path,
               name='one.json', check=False)
    assert p.returncode != 0 and 'resume it on as many (torchrun --nproc_per_node=2)' in p.stdout + p.stderr


SPLIT_K1 = dict(sampler_ranks=1, max_staleness=1)


@pytest.mark.parametrize('overrides, world_size, message', [
    (dict(max_staleness=-1), 1, "max_staleness=-1 must be >= 0"),
    (dict(stale_correction='is'), 1,
     "unknown stale_correction 'is'; choose one of decoupled, tis, none"),
    (dict(sampler_ranks=1), 2,
     r"sampler_ranks=1 samples while the trainers update, .* set max_staleness >= 1"),
    (SPLIT_K1, 1, r"launch with torchrun --nproc_per_node > 1 \(this run has 1 rank"),
    (dict(SPLIT_K1, sampler_ranks=2), 3, "sampler_ranks=2 is more than the 1 ranks that train"),
    (dict(SPLIT_K1, parallel='fsdp'), 2, "use parallel='ddp'"),
    (dict(SPLIT_K1, prompts_per_step=4), 4,
     "prompts_per_step=4 is not divisible by the 3 ranks that train")])
def test_bad_stale_settings_are_refused_in_one_line(overrides, world_size, message, tmp_path):
    from configurator import check_config, configure
    from test_config import DEFAULTS
    c = dict(configure(DEFAULTS, []), out_dir=str(tmp_path), **overrides)
    with pytest.raises(ValueError, match=message):
        check_config(c, world_size=world_size, distributed=world_size > 1)


# train.py under torchrun, a rank sent a signal (SIGKILL: nothing it can catch) where `when`
# holds on a call of module.name's
DIES = """
import os, runpy, signal, sys
import rollout
from lib import checkpoint, stream

def dies_in(module, name, when):
    real = getattr(module, name)
    def wrapped(*args, **kwargs):
        if os.environ['RANK'] == '{rank}' and when(*args, **kwargs):
            os.kill(os.getpid(), signal.{signal})
        return real(*args, **kwargs)
    setattr(module, name, wrapped)

dies_in({where})
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""
MOMENTS = {
    # iteration 3, after its checkpoint, samples iteration 5's groups ahead
    'sampling ahead': "rollout, 'rollout', lambda *args, it, **kwargs: it == 5",
    # checkpoint 4 is being written: its rollouts in flight, rank 0's on disk already
    'writing its rollouts in flight': (
        "checkpoint, 'save_file', lambda tensors, file: 'ckpt-000004.tmp/stream.rank1' in file"),
}


@pytest.fixture(scope='module')
def two_ranks(policy, tmp_path_factory):
    """The run a stopped one must resume to: K = 2 on 2 ranks, 6 iterations."""
    out = tmp_path_factory.mktemp('two-ranks')
    launch([TINY + ['--max_staleness=2', f'--init_from={policy}', f'--out_dir={out}/straight']], out,
           TORCHRUN + ['--standalone', '--nproc_per_node=2'])
    return out / 'straight'


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo on Linux')
@pytest.mark.parametrize('moment', MOMENTS)
def test_a_rank_that_dies_stops_the_run_in_one_line_and_loses_no_checkpoint(policy, two_ranks,
                                                                              tmp_path, moment):
    """K = 2 on 2 ranks, rank 1 killed mid-iteration: rank 0 stops with one line (no traceback)
    naming the last checkpoint, before the iteration, whole (never one rank 1 did not finish),
    and resuming from it on 2 ranks is the run never stopped."""
    args = TINY + ['--max_staleness=2']
    two = TORCHRUN + ['--standalone', '--nproc_per_node=2']
    (tmp_path / 'dies.py').write_text(DIES.format(where=MOMENTS[moment], rank=1, signal='SIGKILL'))
    died = tmp_path / 'died'
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    p = subprocess.run([*two, str(tmp_path / 'dies.py'), 'train.py', *args,
                        f'--init_from={policy}', f'--out_dir={died}'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    said = [line for line in p.stderr.splitlines() if line.startswith('error: rank 0 stopped')]
    assert len(said) == 1 and 'another rank is gone (' in said[0], p.stderr[-3000:]
    whole = f"the last checkpoint, {died}/ckpt-000003, is whole: resume with init_from='resume'"
    assert whole in said[0]
    # gloo's own message, with its source file, is only in a traceback
    assert 'gloo/transport' not in p.stderr
    assert json.load(open(died / 'latest')) == 'ckpt-000003'
    launch([args + ['--init_from=resume', f'--out_dir={died}']], tmp_path, two, name='resume.json')
    for file in ('model.safetensors', 'optimizer.safetensors'):
        assert max_diff(weights(two_ranks, file), weights(died, file)) == 0
    assert metric_lines(two_ranks)[3:] == metric_lines(died)[-3:]


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo on Linux')
def test_every_layout_of_ranks_and_max_rows_learns_the_same(policy, tmp_path):
    """K = 0, 3 iterations of mu = 2: 1 or 2 ranks, each decoding all its rows at once
    (max_rows = 0), one group (G) or two (2G) at a time. In float64 refill draws the
    completions all rows at once do (test_refill.py), so every layout learns the same: metrics
    and weights bitwise on one rank, to 1e-10 on two (the gradient summed over ranks in another
    order, as are the metrics but the layout's own), the rewards bitwise on both."""
    G, results = 4, {}
    for ranks in (1, 2):
        launcher = [sys.executable]
        if ranks > 1:
            launcher = TORCHRUN + ['--standalone', f'--nproc_per_node={ranks}']
        launch([TINY + ['--max_iters=3', f'--init_from={policy}', f'--max_rows={m}',
                        f'--out_dir={tmp_path}/{ranks}-{m}'] for m in (0, G, 2 * G)],
               tmp_path, launcher, name=f'{ranks}.json')
        for m in (0, G, 2 * G):
            out = tmp_path / f'{ranks}-{m}'
            rows = [{k: v for k, v in r.items() if not k.startswith('mem/')}
                    for r in metric_lines(out)]
            results[ranks, m] = weights(out), rows
    ref_weights, ref_rows = results[1, 0]
    assert max_diff(ref_weights, load_file(os.path.join(policy, 'model.safetensors'))) > 1e-4
    assert len(ref_rows) == 3 and len({r['reward'] for r in ref_rows}) > 1
    for (ranks, m), (got, rows) in results.items():
        assert max_diff(got, ref_weights) <= (0 if ranks == 1 else 1e-10), (ranks, m)
        if ranks == 1:
            assert rows == ref_rows, m
            continue
        for got_row, want in zip(rows, ref_rows):
            assert got_row.keys() == want.keys()
            # the same completions: their rewards and lengths exactly
            same = ('reward', 'reward_std', 'len_mean')
            assert all(got_row[k] == want[k] for k in same), (m, got_row)
            for k, v in want.items():
                if k in LAYOUT_METRICS:
                    continue
                assert got_row[k] == pytest.approx(v, rel=1e-12, abs=1e-15), (ranks, m, k)


def test_the_measurement_script_runs_and_draws_at_toy_size():
    """docs/make_async_figure.py --check: its runs (K = 0, and 2 with and without the
    correction) through train.py, its table and its figure, at toy sizes in a temp dir."""
    p = subprocess.run([sys.executable, 'docs/make_async_figure.py', '--check'], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = [line.split(' | ') for line in p.stdout.splitlines() if line.startswith('k')]
    assert [row[0].strip() for row in table] == ['k0-none', 'k2-none', 'k2-decoupled']
    # an evaluation at 0, 2 and 4 a run
    assert all(len(json.loads(row[1])) == 3 for row in table), p.stdout
    pytest.importorskip('matplotlib')
    assert 'wrote ' in p.stdout and 'async_run.png' in p.stdout


# sampler_ranks = 1 on 2 ranks: rank 1 samples, rank 0 trains (issue 57 item 2)
SPLIT = TINY + ['--max_staleness=2', '--sampler_ranks=1']


def split_run(args, tmp_path, wrapper=None):
    """train.py under torchrun on 2 ranks, through tests/multi_run.py, or as
    `torchrun wrapper train.py ARGS` (check=False: the run may fail)."""
    two = TORCHRUN + ['--standalone', '--nproc_per_node=2']
    if not wrapper:
        return launch([args], tmp_path, two, name='split.json')
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    return subprocess.run([*two, str(wrapper), 'train.py', *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope='module')
def one_process(policy, tmp_path_factory):
    """The run a split must be: K = 2 on one process, 6 iterations, each checkpointed."""
    out = tmp_path_factory.mktemp('one-process')
    launch([TINY + ['--max_staleness=2', f'--init_from={policy}', f'--out_dir={out}']], out)
    return out


def same_run(a, b):
    """Metrics (timings aside) and the last checkpoint's weights and optimizer state, byte for
    byte."""
    assert metric_lines(a) == metric_lines(b)
    latest = json.load(open(a / 'latest'))
    assert latest == json.load(open(b / 'latest'))
    for file in ('model.safetensors', 'optimizer.safetensors'):
        assert (a / latest / file).read_bytes() == (b / latest / file).read_bytes(), file


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo on Linux')
def test_a_sampler_rank_samples_what_one_process_would(policy, one_process, tmp_path):
    """Rank 1 only samples, with each version's weights rank 0 sends it, and rank 0 trains on
    what it sends back: the metrics and the checkpoints of the one-process stream, bitwise. The
    trainer's wait for its groups and the sampler's for its weights are logged."""
    split_run(SPLIT + [f'--init_from={policy}', f'--out_dir={tmp_path}/split'], tmp_path)
    same_run(one_process, tmp_path / 'split')
    rows = [json.loads(line) for line in open(tmp_path / 'split' / 'metrics.jsonl')]
    waits = ('time/wait_groups', 'time/wait_weights')
    assert len(rows) == 6 and all(k in r for r in rows for k in waits)
    # the sampler's rollouts, not one a trainer drew: the one-process run has no wait
    assert 'time/wait_weights' not in json.loads(open(one_process / 'metrics.jsonl').readline())
    line = stream.line(rows[-1])
    assert ' | idle: trainer ' in line and '%, sampler ' in line, line


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo on Linux')
def test_a_stop_under_sampler_ranks_resumes_bitwise(policy, one_process, tmp_path):
    """SIGTERM to the trainer as it takes iteration 3, which it finishes taking: it sends the
    sampler version 3, which draws iteration 5, a rollout the checkpoint must not keep. The
    checkpoint before iteration 3 holds iterations 3 and 4's groups, the sampler rank exits
    with the trainer's code, and the printed command resumes to the one-process run, bitwise."""
    (tmp_path / 'term.py').write_text(DIES.format(
        where="stream.Stream, 'take', lambda self, it: it == 3", rank=0, signal='SIGTERM'))
    # no checkpoint but the stop's (and the last)
    args, out = SPLIT + ['--save_interval=0'], tmp_path / 'stopped'
    p = split_run(args + [f'--init_from={policy}', f'--out_dir={out}'], tmp_path,
                  wrapper=tmp_path / 'term.py')
    assert 'stopped by SIGTERM before iteration 3' in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    # both ranks exit with 128 + SIGTERM (torchrun's report), neither with a traceback
    codes = [line.split()[2] for line in p.stderr.splitlines() if 'exitcode  :' in line]
    assert codes == [str(128 + signal.SIGTERM)] * 2, p.stderr[-3000:]
    assert 'train.py", line' not in p.stderr, p.stderr[-3000:]
    command = p.stdout.split('resume with:\n')[1].splitlines()[0].split()
    assert command[:3] == ['torchrun', '--standalone', '--nproc_per_node=2'], command
    assert '--sampler_ranks=1' in command and command[-1] == '--init_from=resume', command
    held = load_file(out / 'ckpt-000003' / 'stream.rank0.safetensors')
    assert sorted({int(k.split('.')[0]) for k in held}) == [3, 4]
    split_run(args + ['--init_from=resume', f'--out_dir={out}'], tmp_path)
    same_run(one_process, out)


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo on Linux')
def test_a_sampler_rank_that_dies_stops_the_trainer_in_one_line(policy, tmp_path):
    """The sampler rank killed while it draws iteration 5 (after checkpoint 3, with version 3):
    the trainer stops with one line naming checkpoint 3, which stays the latest: checkpoint 4
    would need that rollout."""
    (tmp_path / 'dies.py').write_text(DIES.format(
        where="rollout, 'rollout', lambda *args, it, **kwargs: it == 5", rank=1, signal='SIGKILL'))
    died = tmp_path / 'died'
    p = split_run(SPLIT + [f'--init_from={policy}', f'--out_dir={died}'], tmp_path,
                  wrapper=tmp_path / 'dies.py')
    assert p.returncode != 0
    said = [line for line in p.stderr.splitlines() if line.startswith('error: rank 0 stopped')]
    assert len(said) == 1 and 'another rank is gone (' in said[0], p.stderr[-3000:]
    assert f"the last checkpoint, {died}/ckpt-000003, is whole" in said[0]
    assert 'gloo/transport' not in p.stderr
    assert json.load(open(died / 'latest')) == 'ckpt-000003'
