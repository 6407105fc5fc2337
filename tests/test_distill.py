"""
On-policy distillation (issue 58, docs/distillation.md): loss.reverse_kl_advantages against a loop, the policy
gradient it gives through grpo_loss against the reverse KL's own gradient (every sequence of a tiny vocabulary
enumerated, float64), then the teacher in train.py: its log-probs under the sampler's truncation, the checks of
its path and tokenizer, and runs with LoRA, DDP, multi-turn, resume and no reward at all.
"""
import itertools
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss import grpo_loss, reverse_kl_advantages  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

DT = torch.float64
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures')


def loop_advantages(logps, teacher, mask, discount):
    """A_t = sum over the later counted tokens s >= t of discount^(s - t) (log q(y_s) - log pi(y_s)), by two loops."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=DT)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                out[i, t] = sum(discount ** (s - t) * (teacher[i, s] - logps[i, s]).item()
                                for s in range(t, T) if mask[i, s])
    return out


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_reverse_kl_advantages_match_a_loop(discount):
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 7, generator=g) < 0.7
    mask[1] = False
    # padding's log-probs are garbage, an observation's are the environment's: neither may reach an advantage
    logps = torch.where(mask, -torch.rand(6, 7, generator=g, dtype=DT), -1e30)
    teacher = torch.where(mask, -2 * torch.rand(6, 7, generator=g, dtype=DT), float('inf'))
    got = reverse_kl_advantages(logps, teacher, mask, discount)
    torch.testing.assert_close(got, loop_advantages(logps, teacher, mask, discount), rtol=1e-12, atol=1e-12)
    assert (got[~mask] == 0).all()


# ----------------------------------------------------------------------------------------------------------------
# the gradient, exactly: a student and a teacher over V = 3 tokens (token 0 ends a sequence), T = 3 steps, every
# sequence enumerated. Each is a table of logits, one row per prefix (it depends on the whole prefix, as a model's).

V, T = 3, 3
PREFIXES = {p: k for k, p in enumerate(p for n in range(T) for p in itertools.product(range(V), repeat=n))}


def sequences():
    """Every sequence the policies can emit, as (tokens padded with 0, mask): it ends at token 0 or after T steps."""
    out = []
    for y in itertools.product(range(V), repeat=T):
        end = next((t + 1 for t, token in enumerate(y) if token == 0), T)
        if all(token == 0 for token in y[end:]):
            out.append((y, [t < end for t in range(T)]))
    return out


def table_logps(table, seqs):
    """(N, T) log pi(y_t | y_<t) of each sequence's tokens, and (N, T, V) the whole distribution at each step."""
    rows = torch.stack([table[PREFIXES[y[:t]]] for y, _ in seqs for t in range(T)]).view(len(seqs), T, V)
    dist = torch.log_softmax(rows, -1)
    tokens = torch.tensor([y for y, _ in seqs])
    return dist.gather(-1, tokens[..., None]).squeeze(-1), dist


def exact_kls(student, teacher, seqs, mask):
    """(the sequences' reverse KL, KL(pi || q) of whole sequences; the KL of each step summed over the states the
    student visits, their probabilities held fixed), exactly: sums over every sequence."""
    logp, dist = table_logps(student, seqs)
    logq, dist_q = table_logps(teacher, seqs)
    p = torch.where(mask, logp, 0.0).sum(-1).exp()  # (N,) each sequence's probability
    sequence_kl = (p * torch.where(mask, logp - logq, 0.0).sum(-1)).sum()
    step_kl = (dist.exp() * (dist - dist_q)).sum(-1)  # (N, T) KL(pi(.|y_<t) || q(.|y_<t))
    return sequence_kl, (p.detach() * torch.where(mask, step_kl, 0.0).sum(-1)).sum()


def reverse_kl_gradients(advantages, loss_type):
    """{discount: (got, want)} for discount 0 and 1. got: E over the student's samples of
    sum_t A_t grad log pi(y_t) through grpo_loss, each sequence weighed by its probability
    as the sampler would draw it, A = advantages(logps, teacher_logps, mask, discount).
    want: -grad of the reverse KL, of each step's at the states the student visits (0) or
    of whole sequences' (1). tests/test_lessons.py checks a student's advantages with it."""
    g = torch.Generator().manual_seed(1)
    student = torch.randn(len(PREFIXES), V, generator=g, dtype=DT).requires_grad_(True)
    teacher = torch.randn(len(PREFIXES), V, generator=g, dtype=DT)
    seqs = sequences()
    mask = torch.tensor([m for _, m in seqs])
    sequence_kl, step_kl = exact_kls(student, teacher, seqs, mask)
    grad = lambda x: torch.autograd.grad(x, student, retain_graph=True)[0]  # noqa: E731
    want = {1.0: grad(sequence_kl), 0.0: grad(step_kl)}
    logp = table_logps(student, seqs)[0]
    logq = table_logps(teacher, seqs)[0]
    p = torch.where(mask, logp, 0.0).sum(-1).exp().detach()  # (N,)
    counts = dict(num_sequences=1, max_completion_length=1, num_tokens=1)
    out = {}
    for discount, grad_kl in want.items():
        # the sampler's log-probs: constants
        A = advantages(logp.detach(), logq, mask, discount)
        loss, _ = grpo_loss(logp, None, None, p[:, None] * A, mask, loss_type=loss_type, **counts)
        out[discount] = grad(loss), grad_kl
    return out


@pytest.mark.parametrize("loss_type", ["dr_grpo", "luspo", "dapo"])
def test_the_policy_gradient_is_the_reverse_kl_s(loss_type):
    """The expected policy gradient is -grad of the reverse KL, of each step's with
    discount=0, of whole sequences' with discount=1; the two differ, so neither passes by
    chance."""
    gradients = reverse_kl_gradients(reverse_kl_advantages, loss_type)
    for got, want in gradients.values():
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (gradients[1.0][1] - gradients[0.0][1]).abs().max() > 1e-3


def test_one_token_is_the_kl_of_one_distribution():
    """T = 1 by hand: -E_y[(log pi(y) - log q(y)) grad log pi(y)] = -grad KL(pi || q) of one softmax."""
    z = torch.tensor([0.3, -1.0, 2.0], dtype=DT, requires_grad=True)
    q = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5], dtype=DT), 0)
    logp = torch.log_softmax(z, 0)
    (grad_kl,) = torch.autograd.grad((logp.exp() * (logp - q)).sum(), z, retain_graph=True)
    A = reverse_kl_advantages(logp.detach()[:, None], q[:, None], torch.ones(3, 1, dtype=torch.bool))
    loss, _ = grpo_loss(logp[:, None], None, None, logp.exp().detach()[:, None] * A,
                        torch.ones(3, 1), loss_type="luspo", num_sequences=1)
    torch.testing.assert_close(torch.autograd.grad(loss, z)[0], grad_kl, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------------------------
# the teacher in the batch: its log-probs of the sampled tokens under the sampler's truncation, by hand

def by_hand(model, row, start, temperature, top_k, top_p):
    """log q(row[t] | row[:t]) for t >= start, q the truncated softmax at the temperature: the top_k likeliest, then
    the fewest of those holding top_p of their mass (the sampled token kept always), from the model's logits."""
    z = model.logits(torch.tensor([row]))[0].double() / temperature  # (T, V)
    out = []
    for t in range(start, len(row)):
        p, order = torch.softmax(z[t - 1], -1).sort(descending=True)
        keep = torch.zeros(len(p), dtype=torch.bool)
        keep[:top_k or len(p)] = True
        if top_p is not None:
            kept = p * keep
            keep &= kept.cumsum(0) - kept < top_p * kept.sum()
        kept_ids = set(order[keep].tolist()) | {row[t]}
        ids = torch.tensor(sorted(kept_ids))
        out.append((z[t - 1, row[t]] - torch.logsumexp(z[t - 1, ids], 0)).item())
    return out


def settings(**kw):
    """make_batch's settings (configurator.run_config's names), one rank on the CPU in float64."""
    return SimpleNamespace(**{**dict(
        num_generations=2, eos_ids=[0], redo_old_logps=False, mask_truncated_completions=False, kl_in_reward=False,
        world_size=1, device='cpu', multi_objective_aggregation='sum_then_normalize', scale_rewards='none',
        advantage_estimator='grpo', teacher_weight=0.7, teacher_discount=0.0, micro_batch_size=2, plain=False,
        dtype='float64', autocast=False, ptdtype=torch.float64, temperature=1.0, logp_top_k=None, logp_top_p=None),
        **kw})


@pytest.mark.parametrize("top_k,top_p,temperature", [(None, None, 1.0), (5, None, 0.7), (None, 0.6, 1.3),
                                                      (8, 0.5, 1.0)])
def test_the_teacher_scores_each_sampled_token_as_sampling_truncates(top_k, top_p, temperature):
    """make_batch with a teacher: each counted token's advantage is the group's plus teacher_weight x (log q_teacher
    - the sampler's log-prob), q_teacher the teacher's distribution truncated as the sampler's was; an observation
    (a multi-turn row's mask hole) and the padding get the group's alone, and info holds each row's reverse KL."""
    from rollout import make_batch
    torch.manual_seed(0)
    student = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=40)).double()
    teacher = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=24, block_size=32, vocab_size=48)).double()
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]).bool()
    tokens = torch.randint(1, 40, (4, 6), generator=g)
    sampler = torch.where(mask, -3 * torch.rand(4, 6, generator=g, dtype=DT), 0.0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=DT)
    groups = [dict(prompt=prompt, tokens=tokens[k:k + 2], mask=mask[k:k + 2], logps=sampler[k:k + 2],
                   rewards=rewards[k:k + 2], truncated=torch.zeros(2, dtype=torch.bool),
                   scores=rewards[k:k + 2, None]) for k, prompt in ((0, [3, 4, 5]), (2, [6, 7]))]
    cfg = settings(logp_top_k=top_k, logp_top_p=top_p, temperature=temperature)
    info = dict(time={})
    batch = make_batch(student, None, groups=groups, info=info, rank=0, cfg=cfg, reward_weights=[1.0],
                       teacher=teacher)
    group = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=DT)
    for b, prompt in enumerate([[3, 4, 5]] * 2 + [[6, 7]] * 2):
        n = int(mask[b].nonzero().max()) + 1
        q = torch.tensor(by_hand(teacher, prompt + tokens[b, :n].tolist(), len(prompt), temperature, top_k, top_p),
                         dtype=DT)
        gap = torch.where(mask[b, :n], q - sampler[b, :n], 0.0)
        want = group[b] + 0.7 * torch.cat([gap, torch.zeros(6 - n, dtype=DT)])
        torch.testing.assert_close(batch['advantages'][b].double(), want, rtol=1e-6, atol=1e-6)
        assert info['teacher_kl'][b].item() == pytest.approx(-gap.sum().item(), rel=1e-12, abs=1e-12)
    assert batch['advantages'].shape == (4, 6) and info['time']['teacher'] > 0
    assert 'teacher_kl' not in make_batch(student, None, groups=groups, info=dict(time={}), rank=0, cfg=cfg,
                                          reward_weights=[1.0]).keys()


# ----------------------------------------------------------------------------------------------------------------
# the settings: each mistake one line, before any work

@pytest.mark.parametrize("overrides, message", [
    (dict(teacher='/no/such/dir'), "teacher='/no/such/dir' is neither a Hugging Face checkpoint directory nor a "
                                   ".gguf file"),
    (dict(teacher=FIXTURES + '/tiny-qwen2-a', teacher_weight=0.0), "teacher_weight=0.0 must be a positive number"),
    (dict(teacher=FIXTURES + '/tiny-qwen2-a', teacher_discount=1.5), "teacher_discount=1.5 must be in [0, 1]"),
    (dict(teacher=FIXTURES + '/tiny-qwen2-a', teacher_dtype='float16'), "unknown teacher_dtype 'float16'"),
])
def test_bad_teacher_settings(overrides, message, tmp_path):
    from configurator import ConfigError, check_config, configure
    from test_config import DEFAULTS
    c = dict(configure(DEFAULTS, []), out_dir=str(tmp_path), **overrides)
    with pytest.raises(ConfigError) as e:
        check_config(c, 1)
    assert message in str(e.value)


def test_a_teacher_reads_the_student_s_ids_or_is_refused(tmp_path):
    """check_teacher: the teacher's own tokenizer (the files beside its weights, its run's, else the byte
    tokenizer) must give the student's ids, and what differs is said; the run must fit its positions."""
    import json
    import shutil
    from configurator import ConfigError, check_teacher
    from lib.tokenizer import get_tokenizer
    bpe = os.path.join(FIXTURES, 'tiny-bpe-a', 'tokenizer.json')
    teacher = shutil.copytree(os.path.join(FIXTURES, 'tiny-qwen2-a'), tmp_path / 'teacher')
    config = GPT.from_pretrained(str(teacher)).config
    check = lambda tokenizer, block_size=32: check_teacher(  # noqa: E731
        config, get_tokenizer(tokenizer), SimpleNamespace(teacher=str(teacher), tokenizer=tokenizer,
                                                          block_size=block_size))
    check('bytes')  # no tokenizer of its own: the byte tokenizer's ids
    with pytest.raises(ConfigError, match=r"reads its own tokenizer \(bytes\), not the student's "
                                          r"\(tokenizer='.*tokenizer.json'\); the student's against the "
                                          r"teacher's: 544 ids against 257"):
        check(bpe)
    # the tokenizer its run was trained with (trainer.json), the same ids under another path
    (teacher / 'trainer.json').write_text(json.dumps(dict(config=dict(tokenizer=bpe))))
    check(shutil.copy(bpe, str(tmp_path / 'copy.json')))
    with pytest.raises(ConfigError, match="257 ids against 544"):
        check('bytes')
    # its own files: one special token renamed
    (teacher / 'trainer.json').unlink()
    spec = json.load(open(bpe))
    spec['added_tokens'][-1]['content'] = '<|renamed|>'
    (teacher / 'tokenizer.json').write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"special tokens only one has: .*<\|renamed\|>"):
        check(bpe)
    (teacher / 'tokenizer.json').unlink()
    with pytest.raises(ConfigError, match="teacher='.*': block_size=512 exceeds the model's 256"):
        check('bytes', block_size=512)


# ----------------------------------------------------------------------------------------------------------------
# train.py with a teacher: a student that learns from it, resume, DDP, LoRA, multi-turn

@pytest.fixture(scope='module')
def teacher(tmp_path_factory):
    """A teacher that knows the task well (a long supervised warm start), the policy fixture's shape."""
    from test_exact import BASE, launch
    out = tmp_path_factory.mktemp('teacher')
    launch([BASE + ['--sft_iters=300', '--sft_learning_rate=3e-3', '--sft_target_acc=0', '--max_iters=0',
                    '--n_layer=2', '--n_head=2', '--n_embd=32', f'--out_dir={out}']], out)
    return str(out / 'warmstart')


def lines(out_dir):
    import json
    return [json.loads(line) for line in open(os.path.join(out_dir, 'metrics.jsonl'))]


def test_a_student_learns_from_the_teacher_alone(policy, teacher, tmp_path):
    """Pure distillation (the reward weighs 0): the reverse KL to the teacher falls as the student trains, and the
    log line and metrics.jsonl carry it."""
    from test_exact import BASE, launch
    p = launch([BASE + [f'--init_from={policy}', f'--teacher={teacher}', "--reward_funcs=('exact_match',)",
                        '--reward_weights=(0.0,)', '--prompts_per_step=16', '--micro_batch_size=16',
                        '--warmup_iters=0', '--max_iters=40', '--save_interval=0', f'--out_dir={tmp_path}/s']],
               tmp_path)
    kl = [m['teacher/kl'] for m in lines(tmp_path / 's')]
    assert sum(kl[-10:]) / 10 < 0.8 * sum(kl[:5]) / 5, kl
    assert 'teacher kl ' in p.stdout


@pytest.mark.parametrize('ranks', [1, 2])
def test_resume_is_bitwise_and_ranks_agree_with_a_teacher(policy, teacher, tmp_path, ranks):
    """4 iterations straight = 2, stop, resume, 2 more (the teacher frozen: nothing of it is saved); on 2 ranks an
    iteration's update is the one on one rank, up to rounding (as tests/test_exact.py's split invariance)."""
    from test_exact import BASE, TORCHRUN, launch, max_diff, metric_lines, weights
    args = BASE + [f'--init_from={policy}', f'--teacher={teacher}', '--teacher_weight=0.5',
                   '--teacher_discount=0.5', '--num_iterations=2', '--loss_type=grpo']
    runs = [args + ['--max_iters=4', f'--out_dir={tmp_path}/straight'],
            args + ['--max_iters=2', f'--out_dir={tmp_path}/resumed'],
            args + ['--init_from=resume', '--max_iters=4', f'--out_dir={tmp_path}/resumed']]
    launch(runs, tmp_path, TORCHRUN + ['--standalone', f'--nproc_per_node={ranks}'] if ranks > 1 else [sys.executable])
    for file in ('model.safetensors', 'optimizer.safetensors'):
        assert max_diff(weights(tmp_path / 'straight', file), weights(tmp_path / 'resumed', file)) == 0, file
    straight, resumed = metric_lines(tmp_path / 'straight'), metric_lines(tmp_path / 'resumed')
    assert [m for m in straight if m['iter'] >= 2] == [m for m in resumed if m['iter'] >= 2]  # the same rollouts
    assert all(m['teacher/kl'] > 0 for m in straight)
    if ranks > 1:
        one_iteration = [args + ['--max_iters=1', f'--out_dir={tmp_path}/{n}'] for n in ('two', 'one')]
        launch(one_iteration[:1], tmp_path, TORCHRUN + ['--standalone', '--nproc_per_node=2'], name='two.json')
        launch(one_iteration[1:], tmp_path, name='one.json')
        assert max_diff(weights(tmp_path / 'two'), weights(tmp_path / 'one')) <= 1e-10


def test_lora_and_multi_turn_learn_from_a_teacher(policy, teacher, tmp_path):
    """LoRA (the adapters move, the teacher is not the base) and multi-turn episodes (the observations in the mask's
    holes carry no advantage: make_batch's test) run with a teacher and log its KL."""
    from test_exact import BASE, MULTI_TURN, launch, weights
    args = BASE + [f'--init_from={policy}', f'--teacher={teacher}', '--max_iters=2']
    launch([args + ['--lora_rank=4', f'--out_dir={tmp_path}/lora'],
            args + [*MULTI_TURN, f'--out_dir={tmp_path}/turns']], tmp_path)
    adapter = weights(tmp_path / 'lora', 'adapter/adapter_model.safetensors')
    assert max(v.abs().max().item() for k, v in adapter.items() if 'lora_B' in k) > 1e-4
    for run in ('lora', 'turns'):
        assert all(m['teacher/kl'] > 0 for m in lines(tmp_path / run)), run
    assert all(m['env/calls'] > 0 for m in lines(tmp_path / 'turns'))  # episodes of more than one turn


def test_fsdp_learns_what_ddp_learns_from_a_teacher(policy, teacher, tmp_path):
    """parallel='fsdp' with a teacher, sharded as the policy is (each rank holds half of it), beside the reference:
    2 iterations on 2 ranks are DDP's, as tests/test_scale.py's FSDP = DDP (float64): the same samples, rewards and
    teacher kl, the loss's stats to rounding, the parameters to 1e-10. And FSDP resumes bitwise: 2 iterations
    straight = 1, stop, resume, 1 more."""
    from safetensors.torch import load_file
    from test_exact import BASE, REWARDS, launch, max_diff, metric_lines, weights
    from test_scale import STATS, TWO, rollouts, same_rollouts
    args = BASE + [f'--init_from={policy}', f'--teacher={teacher}', '--teacher_weight=0.5', '--teacher_discount=0.5',
                   '--num_iterations=2', '--loss_type=grpo', '--beta=0.04', REWARDS]
    runs = [args + [f'--parallel={par}', '--max_iters=2', f'--out_dir={tmp_path}/{par}'] for par in ('ddp', 'fsdp')]
    resumed = args + ['--parallel=fsdp', f'--out_dir={tmp_path}/resumed']
    launch(runs + [resumed + ['--max_iters=1'], resumed + ['--init_from=resume', '--max_iters=2']], tmp_path, TWO)
    # the second iteration's sampler log-probs, in the teacher kl, round as the policy does
    same_rollouts(tmp_path / 'fsdp', tmp_path / 'ddp', stats=STATS + ('teacher/kl',))
    assert max_diff(weights(tmp_path / 'fsdp'), weights(tmp_path / 'ddp')) <= 1e-10
    assert max_diff(weights(tmp_path / 'fsdp'), load_file(os.path.join(policy, 'model.safetensors'))) > 1e-4
    ddp, fsdp = metric_lines(tmp_path / 'ddp'), metric_lines(tmp_path / 'fsdp')
    assert all(m['teacher/kl'] > 0 for m in fsdp) and ddp[0]['teacher/kl'] == fsdp[0]['teacher/kl']
    # rank 0's part of the teacher after its forward: all of it under DDP; under FSDP half (and the odd
    # vocabulary's extra row), the root's weights (embeddings, output layer) resharded too
    assert 0.45 < fsdp[0]['mem/teacher_mb'] / ddp[0]['mem/teacher_mb'] < 0.55
    for file in ('model.safetensors', 'optimizer.rank0.safetensors', 'optimizer.rank1.safetensors',
                 'ref/model.safetensors'):
        assert max_diff(weights(tmp_path / 'fsdp', file), weights(tmp_path / 'resumed', file)) == 0, file
    assert rollouts(tmp_path / 'fsdp')[1:] == rollouts(tmp_path / 'resumed')[1:]
