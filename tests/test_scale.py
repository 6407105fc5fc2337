"""
Past one GPU's memory (issue 14): FSDP2 gives DDP's update exactly, resumes bitwise and survives SIGKILL; LoRA trains
only its adapters, exactly on any layout, and resumes bitwise. All through train.py itself (tests/multi_run.py), in
float64 on CPU with gloo, from the warm policy test_exact.py builds.
"""
import os
import random
import signal
import subprocess
import sys
import time

from safetensors.torch import load_file

from loss import LOSS_TYPES
from test_exact import BASE, MULTI_TURN, REWARDS, ROOT, TORCHRUN, launch, max_diff, metric_lines, weights

TWO = TORCHRUN + ['--standalone', '--nproc_per_node=2']
# a step that uses the reference model and two passes over the rollout (mu = 2: the ratio and clipping at work)
STEP = BASE + ['--max_iters=1', '--beta=0.04', '--num_iterations=2', '--scale_rewards=group', REWARDS]
STATS = ('kl', 'ratio/mean', 'ratio/max', 'entropy', 'grad_norm', 'clip_ratio/low', 'clip_ratio/high',
         'clip_ratio/region', 'sampler/logp_diff', 'sampler/rho_max', 'sampler/kl')
LORA = ['--lora_rank=4', '--lora_alpha=8', '--learning_rate=3e-2']


def rollouts(out_dir):
    """The logged lines without timing and memory (which differ between DDP and FSDP): rewards, lengths, stats."""
    return [{k: v for k, v in m.items() if not k.startswith('mem/')} for m in metric_lines(out_dir)]


def same_rollouts(a, b, stats=STATS):
    """The same rewards, lengths and counts; the loss's stats to rounding (an all-reduce and a reduce-scatter may
    round a gradient's last bit differently, and mu = 2's second pass sees that)."""
    a, b = rollouts(a), rollouts(b)
    assert [m.keys() for m in a] == [m.keys() for m in b]
    for x, y in zip(a, b):
        for k in x:
            assert abs(x[k] - y[k]) <= 1e-9 * max(1, abs(x[k])) if k in stats else x[k] == y[k], (k, x[k], y[k])


def test_fsdp_equals_ddp_and_one_rank(policy, tmp_path):
    """For every loss_type: FSDP on 2 ranks = DDP on 2 ranks (the same rollouts, the same parameters) = 1 rank with
    twice the accumulation; and with LoRA, the same adapters on all three layouts."""
    runs = {(lt, par): STEP + [f'--init_from={policy}', f'--loss_type={lt}', f'--parallel={par}',
                               f'--out_dir={tmp_path}/{par}/{lt}'] for lt in LOSS_TYPES for par in ('ddp', 'fsdp')}
    runs.update({('lora', par): STEP + LORA + [f'--init_from={policy}', f'--parallel={par}', '--lora_save_merged=True',
                                               f'--out_dir={tmp_path}/{par}/lora'] for par in ('ddp', 'fsdp')})
    for name, extra in (('turns', MULTI_TURN), ('turns-lora', MULTI_TURN + LORA)):  # multi-turn rollouts too
        runs.update({(name, par): STEP + extra + [f'--init_from={policy}', f'--parallel={par}',
                                                  f'--out_dir={tmp_path}/{par}/{name}'] for par in ('ddp', 'fsdp')})
    launch(list(runs.values()), tmp_path, TWO, name='two.json')
    one = [STEP + [f'--init_from={policy}', f'--loss_type={lt}', f'--out_dir={tmp_path}/one/{lt}']
           for lt in LOSS_TYPES if lt != 'bnpo'] + [STEP + LORA + [f'--init_from={policy}',
                                                                   f'--out_dir={tmp_path}/one/lora']]
    one += [STEP + extra + [f'--init_from={policy}', f'--out_dir={tmp_path}/one/{name}']
            for name, extra in (('turns', MULTI_TURN), ('turns-lora', MULTI_TURN + LORA))]
    launch(one, tmp_path, [sys.executable], name='one.json')
    start = load_file(os.path.join(policy, 'model.safetensors'))
    for lt in LOSS_TYPES:
        fsdp, ddp = weights(f'{tmp_path}/fsdp/{lt}'), weights(f'{tmp_path}/ddp/{lt}')
        assert max_diff(fsdp, ddp) <= 1e-10, lt
        assert max_diff(fsdp, start) > 1e-4, lt  # the step did something
        same_rollouts(f'{tmp_path}/fsdp/{lt}', f'{tmp_path}/ddp/{lt}')
        if lt != 'bnpo':  # a mean per micro-batch: split-dependent by definition
            assert max_diff(fsdp, weights(f'{tmp_path}/one/{lt}')) <= 1e-10, lt
    adapters = {where: weights(f'{tmp_path}/{where}/lora', 'adapter/adapter_model.safetensors')
                for where in ('ddp', 'fsdp', 'one')}
    assert max_diff(adapters['fsdp'], adapters['ddp']) <= 1e-10
    assert max_diff(adapters['one'], adapters['ddp']) <= 1e-10
    assert max(v.abs().max().item() for k, v in adapters['one'].items() if 'lora_B' in k) > 1e-4  # B moved from 0
    for where in ('ddp', 'fsdp', 'one'):  # the base is frozen: the checkpoint's model is the policy it started from
        assert max_diff(weights(f'{tmp_path}/{where}/lora'), start) == 0, where
    merged = {where: weights(f'{tmp_path}/{where}/lora', 'merged/model.safetensors') for where in ('ddp', 'fsdp')}
    assert max_diff(merged['fsdp'], merged['ddp']) <= 1e-10 and max_diff(merged['fsdp'], start) > 1e-6
    for name, file in (('turns', 'model.safetensors'), ('turns-lora', 'adapter/adapter_model.safetensors')):
        got = {where: weights(f'{tmp_path}/{where}/{name}', file) for where in ('ddp', 'fsdp', 'one')}
        assert max_diff(got['fsdp'], got['ddp']) <= 1e-10 and max_diff(got['one'], got['ddp']) <= 1e-10, name
        same_rollouts(f'{tmp_path}/fsdp/{name}', f'{tmp_path}/ddp/{name}')


def test_fsdp_compiled_is_fsdp_eager(policy, tmp_path):
    """compile=True under FSDP (the Qwen recipes compile; FSDP's per-block hooks are graph breaks, which the decode
    step's one-graph compile refused): the same samples and rewards as eager FSDP, and the same two optimizer steps
    to compiled code's rounding (it orders the float64 sums differently; AdamW's first steps move every weight by
    ~lr whatever its gradient's size, so 1e-16 becomes ~1e-7 where a gradient is near zero)."""
    runs = [STEP + [f'--init_from={policy}', '--loss_type=dr_grpo', '--parallel=fsdp', f'--compile={c}',
                    f'--out_dir={tmp_path}/{c}'] for c in (False, True)]
    launch(runs, tmp_path, TWO)
    (eager,), (compiled,) = rollouts(f'{tmp_path}/False'), rollouts(f'{tmp_path}/True')
    for k in ('reward', 'len_mean', 'truncated', 'acc', 'flat_groups'):
        assert eager[k] == compiled[k], k
    for k in STATS:
        assert abs(eager[k] - compiled[k]) <= 1e-6 * max(1, abs(eager[k])), (k, eager[k], compiled[k])
    assert max_diff(weights(f'{tmp_path}/False'), weights(f'{tmp_path}/True')) <= 1e-5  # the steps: ~3e-3 each


def test_fsdp_bitwise_resume(policy, tmp_path):
    """4 iterations straight = 2, stop, resume, 2 more, under FSDP, full and LoRA (one launch for both): weights or
    adapters, each rank's optimizer shard, the reference model and the rollouts."""
    args = BASE + ['--loss_type=grpo', '--beta=0.04', '--num_iterations=2', '--parallel=fsdp', REWARDS]
    kinds = {'full': ['--ref_sync_every=2'], 'lora': LORA}
    runs = [args + knobs + run for kind, knobs in kinds.items() for run in (
        [f'--init_from={policy}', '--max_iters=4', f'--out_dir={tmp_path}/{kind}/straight'],
        [f'--init_from={policy}', '--max_iters=2', f'--out_dir={tmp_path}/{kind}/resumed'],
        ['--init_from=resume', '--max_iters=4', f'--out_dir={tmp_path}/{kind}/resumed'])]
    launch(runs, tmp_path, TWO)
    for kind in kinds:
        files = ['model.safetensors', 'optimizer.rank0.safetensors', 'optimizer.rank1.safetensors',
                 'adapter/adapter_model.safetensors' if kind == 'lora' else 'ref/model.safetensors']
        straight, resumed = tmp_path / kind / 'straight', tmp_path / kind / 'resumed'
        for file in files:
            assert max_diff(weights(straight, file), weights(resumed, file)) == 0, (kind, file)
        assert [r for r in rollouts(straight) if r['iter'] >= 2] == [r for r in rollouts(resumed) if r['iter'] >= 2]
    # the optimizer state is sharded two ways: resuming on one rank, or under DDP, is refused in one line
    p = subprocess.run([sys.executable, 'train.py', *args, '--parallel=ddp', '--init_from=resume', '--max_iters=5',
                        f'--out_dir={tmp_path}/full/resumed'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and p.stderr.count('\n') == 1, p.stderr[-2000:]
    assert "parallel='fsdp' on 2 rank(s); resume it with --parallel=fsdp and torchrun --nproc_per_node=2" in p.stderr


def test_fsdp_sigkill_never_loses_the_checkpoint(policy, tmp_path):
    """SIGKILL of torchrun and both ranks at a random moment (checkpoints every iteration, so it may land mid-write;
    test_faults.py kills a single process five times): the latest checkpoint loads, every rank's optimizer shard
    included, and the run resumes from it."""
    env = dict(os.environ, OMP_NUM_THREADS='1')
    args = BASE + [f'--init_from={policy}', '--parallel=fsdp', f'--out_dir={tmp_path}']
    latest = lambda: (tmp_path / 'latest').read_text() if os.path.exists(tmp_path / 'latest') else None
    p = subprocess.Popen([*TWO, 'train.py', *args, '--max_iters=100000'], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while latest() is None and time.time() < deadline:  # the first checkpoint, then a random moment
        time.sleep(0.02)
    time.sleep(random.Random(0).uniform(0.05, 1.0))
    workers = open(f'/proc/{p.pid}/task/{p.pid}/children').read().split()  # in sessions of their own
    for pid in [p.pid, *map(int, workers)]:  # all at once, as a node that loses power
        os.kill(pid, signal.SIGKILL)
    p.wait()
    name = latest().strip().strip('"')
    for file in ('model.safetensors', 'optimizer.rank0.safetensors', 'optimizer.rank1.safetensors'):
        load_file(tmp_path / name / file)
    it = int(name.split('-')[1])
    p = subprocess.run([*TWO, 'train.py', *args, f'--max_iters={it + 1}', '--init_from=resume'], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert latest().strip().strip('"') == f'ckpt-{it + 1:06d}'
