"""
Exact at any scale (issue 5): the same update whatever the split of the step across ranks and micro-batches,
multi-node = single node, bitwise resume, and the ranks' checksum. All through train.py itself (tests/multi_run.py),
in float64 on CPU with gloo.
"""
import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid

import pytest
from safetensors.torch import load_file

from lib.sandbox import sandbox_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, '-m', 'torch.distributed.run']
# a small, fast, fully deterministic run: float64, 1-digit addition, every iteration checkpointed
BASE = ['--dtype=float64', '--eval_interval=0', '--save_interval=1', '--prompts_per_step=4', '--num_generations=4',
        "--task_options={'digits': 1}", '--max_completion_length=4', '--block_size=16', '--learning_rate=3e-3',
        '--sft_iters=0', '--lr_schedule=constant', '--warmup_iters=2', '--micro_batch_size=4',
        '--peak_flops=1e12']  # a given peak: measuring it costs each run ~1 s (test_train.py measures it)


def stop(p):
    """SIGTERM, which torchrun passes on to its workers: they run in sessions of their own, so a SIGKILL of torchrun
    alone (what subprocess.run sends on a timeout) would leave them running, and holding its pipes, into later tests."""
    p.terminate()
    try:
        return p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.communicate(timeout=60)


def launch(runs, tmp_path, launcher=(sys.executable,), name='runs.json', check=True):
    spec = tmp_path / name
    spec.write_text(json.dumps(runs))
    env = dict(os.environ, OMP_NUM_THREADS='1')
    cmd = [*launcher, os.path.join(ROOT, 'tests', 'multi_run.py'), str(spec)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        out, err = stop(p)
        raise AssertionError(f"{' '.join(cmd)} timed out:\n{out[-3000:]}\n{err[-6000:]}")
    # no relaunch: the rare failure one covered up is found (a rank aborting at its exit, fixed in multi_run.py), and
    # a retry would hide the next real one
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{out[-3000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def free_port():
    """A port for the two 'nodes'' rendezvous, new for each test: a fixed one is shared with any other session of the
    suite on this machine (two pairs of nodes would meet in one rendezvous) and with a leftover of a killed run. Picked
    below the kernel's ephemeral range, so no connection opened meanwhile gets it as its own port before torchrun
    binds it (--standalone needs none of this: torchrun binds its stores to port 0 itself)."""
    low = 32768  # Linux's default start of the ephemeral range
    if os.path.exists('/proc/sys/net/ipv4/ip_local_port_range'):
        low = int(open('/proc/sys/net/ipv4/ip_local_port_range').read().split()[0])
    for port in random.Random().sample(range(low // 2, low), 100):
        with socket.socket() as s:
            try:
                s.bind(('localhost', port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in {low // 2}..{low}")


def weights(out_dir, file='model.safetensors'):
    latest = json.load(open(os.path.join(out_dir, 'latest')))
    return load_file(os.path.join(out_dir, latest, file))


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# exact answers are still rare for this small policy; the overlong penalty makes the rewards of a group differ anyway
REWARDS = "--reward_funcs=('exact_match', 'overlong')"
CASES = [(lt, beta, mu) for lt in ('grpo', 'dr_grpo', 'dapo', 'luspo') for beta in (0.0, 0.04) for mu in (1, 2)]
LAYOUTS = {'1 rank x 4 micro-batches': (1, 4), '2 ranks x 2': (2, 4), '2 ranks x 1 (micro-batch doubled)': (2, 8)}


def test_split_invariance(policy, tmp_path):
    """One rollout, one optimizer step (two with mu = 2), three layouts: the same parameters after it."""
    results = {}
    for layout, (ranks, micro) in LAYOUTS.items():
        runs = [BASE + [f'--init_from={policy}', '--max_iters=1', f'--loss_type={lt}', f'--beta={beta}',
                        f'--num_iterations={mu}', f'--micro_batch_size={micro}', '--scale_rewards=group', REWARDS,
                        f'--out_dir={tmp_path}/{ranks}x{micro}/{lt}-{beta}-{mu}'] for lt, beta, mu in CASES]
        launch(runs, tmp_path, TORCHRUN + ['--standalone', f'--nproc_per_node={ranks}'] if ranks > 1 else
               [sys.executable], name=f'{ranks}x{micro}.json')
        results[layout] = {c: weights(f'{tmp_path}/{ranks}x{micro}/{c[0]}-{c[1]}-{c[2]}') for c in CASES}
    start = load_file(os.path.join(policy, 'model.safetensors'))
    ref = results['1 rank x 4 micro-batches']
    for layout, got in results.items():
        for case in CASES:  # bnpo, a mean per micro-batch, depends on which rows share one (they are sorted by length)
            assert max_diff(got[case], ref[case]) <= 1e-10, (layout, case)
    for case in CASES:  # and the step did something
        assert max_diff(ref[case], start) > 1e-4, case
    # some of those steps' sequences held a prompt once for two of its rows (rollout.micro_batches), laid out
    # differently in each layout
    shared = [json.loads(line).get('saved_share', 0) for lt, beta, mu in CASES
              for line in open(f'{tmp_path}/1x4/{lt}-{beta}-{mu}/metrics.jsonl')]
    assert max(shared) > 0, shared


# the plain path (train.py's plain=True: padded micro-batches, the output layer's log_softmax(logits).gather) against
# the fast one: off-policy log-prob passes with a reference, the entropy's gradient, a multi-turn run, LoRA
PLAIN_CASES = {
    'dr_grpo': [],
    'mu=2, beta': ['--num_iterations=2', '--beta=0.04', '--loss_type=grpo'],
    'entropy': ['--top_entropy_quantile=0.5', '--entropy_coef=0.01', '--loss_type=dapo'],
    'multi-turn': ['--env=multiturn_env:Echo', '--max_turns=3', '--max_completion_length=12', '--loss_type=dapo'],
    'lora': ['--lora_rank=4', '--beta=0.04'],
    # log q (issue 47): the old, new and reference passes each find the kept set from their own logits
    'top-k/top-p': ['--top_k=20', '--top_p=0.8', '--num_iterations=2', '--beta=0.04', '--loss_type=grpo'],
}


def test_plain_path_equals_the_fast_one(policy, tmp_path):
    """Every speed trick off gives the same parameters after a step, and each run did take its own path."""
    runs = [BASE + [f'--init_from={policy}', '--max_iters=1', f'--plain={plain}', REWARDS, *extra,
                    f'--out_dir={tmp_path}/{plain}/{name}'] for name, extra in PLAIN_CASES.items()
            for plain in (False, True)]
    launch(runs, tmp_path)
    start = load_file(os.path.join(policy, 'model.safetensors'))
    saved = {}
    for name in PLAIN_CASES:
        lora = name == 'lora'  # its step moves the adapters only; B starts at zero
        file = 'adapter/adapter_model.safetensors' if lora else 'model.safetensors'
        fast, plain = weights(f'{tmp_path}/False/{name}', file), weights(f'{tmp_path}/True/{name}', file)
        assert max_diff(fast, plain) <= 1e-10, name
        moved = max(v.abs().max().item() for k, v in fast.items() if 'lora_B' in k) if lora else max_diff(fast, start)
        assert moved > 1e-4, name
        saved[name] = [json.loads(open(f'{tmp_path}/{p}/{name}/metrics.jsonl').readline())['saved_share']
                       for p in (False, True)]
        assert json.load(open(f'{tmp_path}/True/{name}/config.json'))['plain'] is True  # out_dir says what ran
    assert max(f for f, _ in saved.values()) > 0 and all(p == 0 for _, p in saved.values()), saved  # packing shared
    # a prompt between rows; the plain path never did


# issue 12's knobs, each in a run of its own (with mu = 2 where it matters only off-policy); the mixup run syncs
# the reference once, at iteration 1
SECOND_WAVE = {
    'sapo': ['--surrogate=sapo', '--loss_type=grpo', '--num_iterations=2'],
    'vespo': ['--surrogate=vespo', '--loss_type=dapo', '--num_iterations=2'],
    'iw-kl': ['--beta=0.04', '--use_bias_correction_kl=True', '--num_iterations=2'],
    'off-policy mask': ['--off_policy_mask_threshold=0.001', '--num_iterations=2'],
    'top entropy + bonus': ['--top_entropy_quantile=0.3', '--entropy_coef=0.01', '--loss_type=dapo'],
    'sampler correction': ['--sampler_correction=sequence_truncate', '--sampler_correction_clip_min=0.5'],
    'rloo': ['--advantage_estimator=rloo'],
    'reinforce_pp': ['--advantage_estimator=reinforce_pp', '--scale_rewards=none'],
    'gdpo': ['--multi_objective_aggregation=normalize_then_sum', '--scale_rewards=none'],
    'mixup': ['--beta=0.04', '--ref_sync_every=1', '--ref_model_mixup_alpha=0.5', '--max_iters=2'],
    'multi-turn': ['--env=multiturn_env:Echo', '--max_turns=3', '--max_completion_length=12', '--loss_type=dapo',
                   '--beta=0.04'],
    # a reward model (its own tokenizer and chat template) beside the verifier, scoring each rank's share
    'reward model': ["--reward_funcs=('exact_match', 'rm:tests/fixtures/rm/qwen2')", '--reward_weights=(1.0, 0.5)',
                     '--reward_model_dtype=float64'],
}
MULTI_TURN, REWARD_MODEL = SECOND_WAVE['multi-turn'], SECOND_WAVE['reward model']


def test_second_wave_split_invariance(policy, tmp_path):
    """Every knob of the second wave gives the same parameters on every layout, like the first wave's."""
    results = {}
    for layout, (ranks, micro) in LAYOUTS.items():
        runs = [BASE + [f'--init_from={policy}', '--max_iters=1', '--scale_rewards=group', REWARDS, *knobs,
                        f'--micro_batch_size={micro}', f'--out_dir={tmp_path}/{ranks}x{micro}/{i}']
                for i, knobs in enumerate(SECOND_WAVE.values())]
        launch(runs, tmp_path, TORCHRUN + ['--standalone', f'--nproc_per_node={ranks}'] if ranks > 1 else
               [sys.executable], name=f'{ranks}x{micro}.json')
        results[layout] = [weights(f'{tmp_path}/{ranks}x{micro}/{i}') for i in range(len(SECOND_WAVE))]
    start = load_file(os.path.join(policy, 'model.safetensors'))
    ref = results['1 rank x 4 micro-batches']
    for layout, got in results.items():
        for name, a, b in zip(SECOND_WAVE, got, ref):
            assert max_diff(a, b) <= 1e-10, (layout, name)
    for name, a in zip(SECOND_WAVE, ref):
        assert max_diff(a, start) > 1e-4, name
    turns = list(SECOND_WAVE).index('multi-turn')  # and its rows did take several turns
    calls = [json.loads(line)['env/calls'] for line in open(f'{tmp_path}/1x4/{turns}/metrics.jsonl')]
    assert min(calls) > 0.2, calls
    rm = list(SECOND_WAVE).index('reward model')  # the same scores on 1 and 2 ranks, and they vary
    scores = [json.loads(open(f'{tmp_path}/{d}/{rm}/metrics.jsonl').readline()) for d in ('1x4', '2x4', '2x8')]
    assert max(abs(s['reward/rm:qwen2'] - scores[0]['reward/rm:qwen2']) for s in scores) < 1e-12, scores
    assert scores[0]['reward_spread/rm:qwen2'] > 0.01


def test_multi_node_equals_single_node(policy, tmp_path):
    """Two torchrun 'nodes' (c10d rendezvous on localhost, one process each) = one node with two processes."""
    args = BASE + [f'--init_from={policy}', '--max_iters=2', '--loss_type=dr_grpo']
    launch([args + [f'--out_dir={tmp_path}/single']], tmp_path, TORCHRUN + ['--standalone', '--nproc_per_node=2'])
    spec = tmp_path / 'multi.json'
    spec.write_text(json.dumps([args + [f'--out_dir={tmp_path}/multi']]))
    node = TORCHRUN + ['--nnodes=2', '--nproc_per_node=1', '--rdzv_backend=c10d', f'--rdzv_id={uuid.uuid4()}',
                       f'--rdzv_endpoint=localhost:{free_port()}', os.path.join(ROOT, 'tests', 'multi_run.py'),
                       str(spec)]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    logs = [tmp_path / f'node{k}.log' for k in range(2)]  # files, not pipes: a node whose pipe is full stalls both
    nodes = []
    for log in logs:
        with open(log, 'w') as f:
            nodes.append(subprocess.Popen(node, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.time() + 300
    # once one node has failed, the other would sit out its exit barrier (300 s) for it: stop it now
    while any(n.poll() is None for n in nodes) and not any(n.poll() for n in nodes) and time.time() < deadline:
        time.sleep(0.2)
    for n in nodes:
        if n.poll() is None:
            stop(n)
    assert all(n.returncode == 0 for n in nodes), [log.read_text()[-4000:] for log in logs]
    assert max_diff(weights(tmp_path / 'multi'), weights(tmp_path / 'single')) == 0


def metric_lines(out_dir):
    timing = ('rollout_tok_s', 'train_tok_s', 'mfu', 'dt', 'mem_mb')
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in timing and not k.startswith('time/')} for r in rows]


# what describes the layout itself, not the step: its padding, the prompts packing shared, each rank's memory
LAYOUT_METRICS = ('pad_share', 'saved_share')
METRIC_LAYOUTS = {'packed, 1 rank x 4': (1, 4, False), 'plain': (1, 4, True), 'micro-batch 8': (1, 8, False),
                  '2 ranks x 4': (2, 4, False)}
# every logged stat of the update in play: a reference (kl), mu = 2 (ratios off 1, clips), the 80/20 mask, a
# sampler correction and the off-policy mask (their shares), the entropy bonus, a gap to the sampler (top-k
# sampling, the full softmax trained)
METRIC_KNOBS = ['--max_iters=3', '--num_iterations=2', '--beta=0.04', '--loss_type=dapo', '--epsilon_low=0.05',
                '--epsilon_high=0.05', '--top_entropy_quantile=0.5', '--entropy_coef=0.01', '--top_k=20',
                '--truncate_logprobs=False', '--sampler_correction=token_truncate',
                '--off_policy_mask_threshold=0.0001', REWARDS]


def test_metrics_are_the_steps_not_the_layouts(policy, tmp_path):
    """Issue 48 (5a): every logged number but the timings, memory and the layout's own is a property of the step:
    the same (to float64's rounding) packed or plain, in micro-batches of 4 or 8, on 1 rank or 2, 3 iterations."""
    logged = {}
    for layout, (ranks, micro, plain) in METRIC_LAYOUTS.items():
        out = f'{tmp_path}/{ranks}x{micro}-{plain}'
        launch([BASE + [f'--init_from={policy}', f'--micro_batch_size={micro}', f'--plain={plain}', *METRIC_KNOBS,
                        f'--out_dir={out}']], tmp_path, TORCHRUN + ['--standalone', f'--nproc_per_node={ranks}']
               if ranks > 1 else [sys.executable], name=f'{ranks}x{micro}-{plain}.json')
        logged[layout] = [{k: v for k, v in r.items() if k not in LAYOUT_METRICS and not k.startswith('mem/')}
                          for r in metric_lines(out)]
    ref = logged['packed, 1 rank x 4']
    assert len(ref) == 3 and all(r['clip_ratio/region'] > 0 and r['kl'] > 0 and r['sampler/kl'] > 0 and
                                 r['off_policy_masked'] > 0 for r in ref[1:]), ref
    differ = [(layout, got['iter'], k, got.get(k), v) for layout, rows in logged.items()
              for got, want in zip(rows, ref) for k, v in want.items()
              if got.keys() != want.keys() or got[k] != pytest.approx(v, rel=1e-12, abs=1e-15)]
    assert not differ, "\n".join(map(str, differ))


@pytest.mark.parametrize('ranks, turns', [(1, []), (2, []), (1, MULTI_TURN), (2, REWARD_MODEL), pytest.param(
    1, MULTI_TURN + ['--env=multiturn_env:Sandboxed'], marks=pytest.mark.skipif(
        sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}"), id='sandboxed tool')])
def test_bitwise_resume(policy, tmp_path, ranks, turns):
    """6 iterations straight = 3, stop, resume, 3 more: weights, optimizer state, reference model and rollouts
    (multi-turn ones too, their observations from a real program in the python tool's sandbox too) and their
    rewards (a reward model's too)."""
    args = BASE + ['--loss_type=grpo', '--beta=0.04', '--num_iterations=2', '--ref_sync_every=2',
                   '--micro_batch_size=4', *turns]
    runs = [args + [f'--init_from={policy}', '--max_iters=6', f'--out_dir={tmp_path}/straight'],
            args + [f'--init_from={policy}', '--max_iters=3', f'--out_dir={tmp_path}/resumed'],
            args + ['--init_from=resume', '--max_iters=6', f'--out_dir={tmp_path}/resumed']]
    launcher = TORCHRUN + ['--standalone', f'--nproc_per_node={ranks}'] if ranks > 1 else [sys.executable]
    launch(runs, tmp_path, launcher)
    for file in ('model.safetensors', 'optimizer.safetensors', 'ref/model.safetensors'):
        a, b = weights(tmp_path / 'straight', file), weights(tmp_path / 'resumed', file)
        assert max_diff(a, b) == 0, file
    straight, resumed = metric_lines(tmp_path / 'straight'), metric_lines(tmp_path / 'resumed')
    assert [r for r in straight if r['iter'] >= 3] == [r for r in resumed if r['iter'] >= 3]  # the same rollouts


def test_ranks_that_diverge_stop_loudly(policy, tmp_path):
    p = launch([{'args': BASE + [f'--init_from={policy}', '--max_iters=1', f'--out_dir={tmp_path}/d'],
                 'diverge': True}], tmp_path, TORCHRUN + ['--standalone', '--nproc_per_node=2'], check=False)
    assert p.returncode != 0
    assert "the ranks' parameters differ" in p.stdout + p.stderr
    assert not os.path.exists(tmp_path / 'd' / 'latest')  # nothing was saved
