"""
The curriculum over prompt difficulty (issue 58, item 3; lib/curriculum.py): a prompt's running pass rate and
streak by hand, the walk that skips retired prompts and brings each back after curriculum_rest passes, today's
prompts when nothing retires, every rank's share of one walk, the pool in the checkpoint (a stopped and resumed run
is the run straight through, bitwise), 2 ranks = 1, the default run untouched, and the checks' one-line errors.
The tests that take a Pool check docs/lessons.md's exercise too (test_lessons.py passes them the student's).
"""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import rollout
from lib import curriculum
from lib.curriculum import Pool
from test_exact import BASE, REWARDS, TORCHRUN, launch, max_diff, metric_lines, weights
from test_faults import train_in_process


def settings(**kw):
    c = dict(prompts_per_step=2, world_size=1, seed=7, num_generations=4, curriculum_easy=0.9,
             curriculum_hard=0.1, curriculum_patience=2, curriculum_rest=1)
    return SimpleNamespace(**dict(c, **kw))


def visit(pool, it, rights):
    """Draw iteration it, then score its groups: rights[k] of the G completions of the k-th prompt right."""
    drawn = pool.draw(it)
    G = pool.cfg.num_generations
    pool.update(torch.tensor([[j < r for j in range(G)] for r in rights]).flatten())
    return drawn


def test_the_pass_rate_and_streak_by_hand(Pool=Pool):
    """One prompt, G = 4: rates 1, 1 (too easy twice: retired, passed curriculum_rest = 3 times, then due), 0.875
    (the EMA, the newest weighing half: active again), 0.4375, ... 0.02734375 (too hard twice); easy at 0.9, hard
    at 0.1, patience 2."""
    cfg = settings(prompts_per_step=1, curriculum_rest=3)
    pool = Pool(1, cfg, start=0, order=rollout.epoch_order)
    want = [(4, 1.0, 1), (4, 1.0, 2), (3, 0.875, 0), (0, 0.4375, 0), (0, 0.21875, 0), (0, 0.109375, 0),
            (0, 0.0546875, -1), (0, 0.02734375, -2)]
    for it, (right, rate, streak) in enumerate(want):
        assert pool.retired(0) == (it == 2)
        (_, position), = visit(pool, it, [right])
        assert (pool.rate[0].item(), int(pool.streak[0])) == (rate, streak), it
        # the retired prompt's next 3 positions were passed
        assert position == it + 3 * (it >= 2), it
    assert pool.retired(0) == -1 and pool.metrics()['pool/hard'] == 1


def todays(n, it, cfg):
    """step_rows' prompts of iteration it on every rank, as (row, position): today's draw."""
    rows = [dict(i=i) for i in range(n)]
    return [(r['i'], r['_id']) for rank in range(cfg.world_size)
            for r in rollout.step_rows(rows, it, rank, cfg)]


@pytest.mark.parametrize('ranks', [1, 2])
def test_with_nothing_retired_the_walk_draws_todays_prompts(ranks):
    """Thresholds no visit reaches: the walk is step_rows' draw, position for position, over several epochs
    (5 rows, 4 prompts an iteration: the iterations straddle epochs), on every rank."""
    cfg = settings(prompts_per_step=4, world_size=ranks, curriculum_easy=1.0, curriculum_hard=0.0)
    pool = Pool(5, cfg, start=0, order=rollout.epoch_order)
    rows = [dict(i=i) for i in range(5)]
    for it in range(12):
        mine = [[(r['i'], r['_id']) for r in rollout.step_rows(rows, it, rank, cfg, pool)] for rank in range(ranks)]
        assert sum(mine, []) == todays(5, it, cfg) == pool.draw(it)
        # each rank its own share: disjoint positions
        assert len({p for share in mine for _, p in share}) == 4
        visit(pool, it, [1, 2, 3, 2])
    assert pool.metrics() == {'pool/active': 5, 'pool/easy': 0, 'pool/hard': 0, 'pool/revisits': 0}


def test_a_retired_prompt_is_passed_rest_times_then_visits_once(Pool=Pool):
    """3 prompts, one drawn an iteration, patience 1, rest 2: prompt A, all right, retires at once; the walk
    passes it twice (its positions skipped), visits it on the third pass, and a visit half right makes it active
    again: a forgotten skill is seen."""
    cfg = settings(prompts_per_step=1, curriculum_patience=1, curriculum_rest=2)
    pool = Pool(3, cfg, start=0, order=rollout.epoch_order)
    walk = [row for e in range(5) for row in rollout.epoch_order(3, e, cfg.seed).tolist()]
    A = walk[0]
    visits, passed, position = [], [], 0
    for it in range(12):
        (row, at), = pool.draw(it)
        visit(pool, it, [4 if row == A and A not in visits else 2])
        passed += walk[position:at]
        visits.append(row)
        position = at + 1
        if visits.count(A) == 2:
            break
    # the prompts passed by: A, twice; then its visit, which brought it back
    assert passed == [A, A] and pool.retired(A) == 0 and pool.rate[A] == 0.75
    assert pool.metrics()['pool/revisits'] == 1 and pool.skipped[A] == 0


def test_the_pool_brute_force(Pool=Pool):
    """Random scores on 6 prompts, 4 an iteration on 2 ranks, against a reference that replays the rule on plain
    lists: the rate an EMA of each visit's share, a streak of visits beyond a threshold, a retired prompt drawn
    when it has been passed curriculum_rest times. The draw and every prompt's state, each iteration."""
    cfg = settings(prompts_per_step=4, world_size=2, curriculum_easy=0.7, curriculum_hard=0.3,
                   curriculum_patience=2, curriculum_rest=2)
    n, G, g = 6, cfg.num_generations, torch.Generator().manual_seed(0)
    pool = Pool(n, cfg, start=0, order=rollout.epoch_order)
    rate, streak, skipped, position = [None] * n, [0] * n, [0] * n, 0
    orders = [rollout.epoch_order(n, e, cfg.seed).tolist() for e in range(200)]
    for it in range(60):
        rights = torch.randint(0, G + 1, (4,), generator=g).tolist()
        want = []
        while len(want) < 4:
            i = orders[position // n][position % n]
            if abs(streak[i]) >= 2 and skipped[i] < 2:
                skipped[i] += 1
            else:
                want.append((i, position))
            position += 1
        assert visit(pool, it, rights) == want, it
        for (i, _), right in zip(want, rights):
            share = right / G
            rate[i] = share if rate[i] is None else (rate[i] + share) / 2
            streak[i] = (max(streak[i], 0) + 1 if rate[i] >= 0.7 else
                         min(streak[i], 0) - 1 if rate[i] <= 0.3 else 0)
            skipped[i] = 0
        assert [r if r is not None else 'nan' for r in rate] == \
            [r if r == r else 'nan' for r in pool.rate.tolist()]
        assert streak == pool.streak.tolist() and skipped == pool.skipped.tolist()
    assert position > 60 * 4  # prompts were skipped
    assert pool.tensors()['position'].item() == position


def test_a_checkpoint_of_another_task_is_refused():
    cfg = settings()
    saved = Pool(5, cfg, start=3, order=rollout.epoch_order).tensors()
    assert saved['position'].item() == 3 * 2 and saved['iter'].item() == 3
    with pytest.raises(ValueError, match='tracks 5 train prompts, this run has 6: resume on the same task'):
        Pool(6, cfg, start=3, order=rollout.epoch_order, saved=saved)


# ----------------------------------------------------------------------------------------------------------------
# through train.py

# The warm policy, 8 prompts of the 91 one-digit sums an iteration: 30 iterations walk more than two epochs. Its
# sums are seldom right: the pass rate here is of the format (ending on a number), right about half the time.
RUN = BASE + ['--prompts_per_step=8', '--micro_batch_size=8', "--reward_funcs=('exact_match', 'format')",
              '--accuracy_func=format', '--curriculum=pass_rate', '--curriculum_easy=0.9',
              '--curriculum_hard=0.1', '--curriculum_patience=1', '--curriculum_rest=1']


def pool_of(out_dir):
    return weights(out_dir, 'curriculum.safetensors')


def test_a_stopped_run_resumes_bitwise(policy, tmp_path):
    """30 iterations straight = 15, then resumed to 30: the pool comes back from the checkpoint; metrics, weights,
    the optimizer and the pool, bitwise. The run retired prompts, passed them and brought them back."""
    args = RUN + ['--max_iters=30']
    launch([args + [f'--init_from={policy}', f'--out_dir={tmp_path}/straight'],
            args + [f'--init_from={policy}', '--max_iters=15', f'--out_dir={tmp_path}/resumed'],
            args + ['--init_from=resume', f'--out_dir={tmp_path}/resumed']], tmp_path)
    for file in ('model.safetensors', 'optimizer.safetensors', 'curriculum.safetensors'):
        assert max_diff(weights(tmp_path / 'straight', file), weights(tmp_path / 'resumed', file)) == 0, file
    straight, resumed = metric_lines(tmp_path / 'straight'), metric_lines(tmp_path / 'resumed')
    assert len(straight) == 30 and straight == resumed
    last = straight[-1]
    assert last['pool/easy'] > 0 and last['pool/hard'] > 0
    assert sum(r['pool/revisits'] for r in straight) > 0
    assert pool_of(tmp_path / 'straight')['position'].item() > 30 * 8  # retired prompts were passed


@pytest.mark.skipif(sys.platform != 'linux', reason='gloo on Linux')
def test_two_ranks_draw_and_learn_what_one_does(policy, tmp_path):
    """Each rank draws its share of the same walk and the pool learns from both ranks' groups: the pool after each
    iteration (its sizes) and at the end (every prompt's rate, streak, skips and the walk's position) is one
    process's, bitwise; the weights to float64 rounding."""
    args = RUN + ['--max_iters=30', f'--init_from={policy}']
    launch([args + [f'--out_dir={tmp_path}/one']], tmp_path)
    launch([args + [f'--out_dir={tmp_path}/two']], tmp_path, TORCHRUN + ['--standalone', '--nproc_per_node=2'],
           name='two.json')
    one, two = pool_of(tmp_path / 'one'), pool_of(tmp_path / 'two')
    assert max_diff(one, two) == 0 and one['position'].item() > 30 * 8
    pools = lambda out: [{k: v for k, v in r.items() if k.startswith(('pool/', 'acc'))}
                         for r in metric_lines(out)]
    assert pools(tmp_path / 'one') == pools(tmp_path / 'two')
    assert max_diff(weights(tmp_path / 'one'), weights(tmp_path / 'two')) < 1e-10


def test_off_is_todays_run_and_a_pool_that_retires_nothing_draws_todays_prompts(policy, tmp_path, monkeypatch):
    """curriculum='' (other curriculum settings changed) never builds a pool (it raises here): the run with the
    settings absent, bitwise, metrics and checkpoint, no pool in either. curriculum='pass_rate' with thresholds no
    group reaches draws the same prompts: the same run but for the pool's metrics."""
    args = BASE + ['--max_iters=4', REWARDS, f'--init_from={policy}']
    train_in_process(args + [f'--out_dir={tmp_path}/absent'])
    with monkeypatch.context() as m:
        m.setattr(curriculum.Pool, '__init__', lambda *a, **k: pytest.fail("a pool with curriculum=''"))
        train_in_process(args + ['--curriculum_patience=5', '--curriculum_easy=0.4', f'--out_dir={tmp_path}/off'])
    train_in_process(args + ['--curriculum=pass_rate', '--curriculum_easy=1.0', '--curriculum_hard=0.0',
                             '--curriculum_patience=100', f'--out_dir={tmp_path}/on'])
    absent, off = metric_lines(tmp_path / 'absent'), metric_lines(tmp_path / 'off')
    on = [{k: v for k, v in r.items() if not k.startswith('pool/')} for r in metric_lines(tmp_path / 'on')]
    assert len(absent) == 4 and absent == off == on and not any(k.startswith('pool') for k in absent[0])
    assert len({r['reward'] for r in absent}) > 1
    for out in ('off', 'on'):
        for file in ('model.safetensors', 'optimizer.safetensors'):
            assert max_diff(weights(tmp_path / 'absent', file), weights(tmp_path / out, file)) == 0
    ckpt = lambda out: os.listdir(tmp_path / out / 'ckpt-000004')
    assert 'curriculum.safetensors' not in ckpt('off') and 'curriculum.safetensors' in ckpt('on')


@pytest.mark.parametrize('overrides, message', [
    (dict(curriculum='pass_rates'), "unknown curriculum 'pass_rates'"),
    (dict(curriculum_easy=0.1, curriculum_hard=0.1), "0 <= curriculum_hard < curriculum_easy <= 1"),
    (dict(curriculum_easy=1.5), "curriculum_easy=1.5 are pass rates"),
    (dict(curriculum_patience=0), "curriculum_patience=0 must be >= 1"),
    (dict(curriculum_rest=0), "curriculum_rest=0 must be >= 1"),
    (dict(curriculum='pass_rate', dynamic_sampling=True), "both choose the prompts .*: use one"),
    (dict(curriculum='pass_rate', max_staleness=2), "max_staleness=2 samples iterations ahead of it: use one")])
def test_bad_curriculum_settings_are_refused_in_one_line(overrides, message, tmp_path):
    from configurator import check_config, configure
    from test_config import DEFAULTS
    c = dict(configure(DEFAULTS, []), out_dir=str(tmp_path), **overrides)
    with pytest.raises(ValueError, match=message):
        check_config(c, world_size=1)
