"""
Issue 47: with top_k/top_p the policy is q, softmax(logits / temperature) renormalised over the
tokens they keep. The sampler draws from q and reports log q; the trainer's log-prob passes (the
chunked head with and without its logits kept, and the plain reference) compute log q from their
own logits, and its gradient is q's. Proven here against loops over small vocabularies that
enumerate q (test_model.expected_probs), in float64.
"""
import pytest
import torch

from loss import group_advantages, grpo_loss
from model import GPT, GPTConfig
from rollout import pack
from test_model import chi_square_critical, expected_probs
from test_train import metrics, run

DT = torch.float64
V = 13  # a vocabulary small enough to enumerate
CUTS = [(None, 0.7), (4, None), (6, 0.8), (1, None)]  # (top_k, top_p)


def tiny(vocab=V, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=32, vocab_size=vocab, n_layer=1, n_head=2, n_embd=16)).to(DT)


def loop_logq(model, idx, start, length, temperature, top_k, top_p):
    """log q (B, length) and q's entropy, one position at a time: the kept set enumerated in
    Python from the full logits (the sampled token kept too), log q = z_t - logsumexp(z over the
    kept set), with autograd."""
    logits = model.logits(idx) / temperature  # (B, T, V)
    out = torch.zeros(idx.shape[0], length, dtype=DT)
    ent = torch.zeros(idx.shape[0], length, dtype=DT)
    for b in range(idx.shape[0]):
        for j in range(length):
            z, t = logits[b, start[b] + j - 1], int(idx[b, start[b] + j])
            q = expected_probs(z.tolist(), 1.0, top_k, top_p)
            kept = [i for i in range(len(q)) if q[i] > 0 or i == t]
            lse = torch.logsumexp(z[kept], 0)
            out[b, j] = z[t] - lse
            ent[b, j] = -sum((z[i] - lse).exp() * (z[i] - lse) for i in kept)
    return out, ent


def grads(loss, model):
    params = list(model.parameters())
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])


@pytest.mark.parametrize('top_k, top_p', CUTS)
@pytest.mark.parametrize('path', ['plain', 'chunked, logits kept', 'chunked, logits recomputed'])
def test_logprobs_entropy_and_gradient_equal_a_loop_over_q(top_k, top_p, path):
    """Random rows of random tokens (so some fall outside the kept set: kept then, as the sampled
    token is): the trainer's log q, q's entropy and the gradient of a loss mixing both equal the
    loop's."""
    model, plain = tiny(), path == 'plain'
    model.gradient_checkpointing = path == 'chunked, logits recomputed'  # the head recomputes them
    g = torch.Generator().manual_seed(1)
    idx, start, length, temperature = torch.randint(0, V, (3, 9), generator=g), \
        torch.tensor([2, 4, 3]), 5, 0.7
    lp, ent = model.logprobs(idx, start, length, temperature, entropy=True, plain=plain,
                             top_k=top_k, top_p=top_p)
    want_lp, want_ent = loop_logq(model, idx, start, length, temperature, top_k, top_p)
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=1e-12, atol=1e-12)
    a = torch.randn(3, length, generator=g, dtype=DT)
    c = torch.randn(3, length, generator=g, dtype=DT)
    got = grads((a * lp + c * ent).sum(), model)
    want = grads((a * want_lp + c * want_ent).sum(), model)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # and q is not the full softmax: its log-probs and gradient differ from those without a cut
    full = model.logprobs(idx, start, length, temperature, plain=plain)
    assert (full - lp).abs().max() > 1e-3
    assert (grads((a * full).sum(), model) - grads((a * lp).sum(), model)).abs().max() > 1e-6


def test_no_top_k_or_top_p_leaves_the_log_probs_untouched():
    """top_k=None, top_p=None: the same numbers to the bit as the call without them."""
    model, idx = tiny(), torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(2))
    for plain in (False, True):
        a = model.logprobs(idx, torch.tensor([2, 3]), 4, 0.9, entropy=True, plain=plain)
        b = model.logprobs(idx, torch.tensor([2, 3]), 4, 0.9, entropy=True, plain=plain,
                           top_k=None, top_p=None)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize('top_k, top_p', [(None, 0.6), (5, 0.9)])
def test_the_sampler_draws_from_the_trainer_s_q(top_k, top_p):
    """generate's first tokens of one prompt, 20,000 samples: their frequencies fit the q that the
    trainer's logprobs gives each of the V tokens after the prompt (chi-square), no token outside
    its support is drawn, and the log-probs generate reports are the trainer's log q."""
    model, prompt, n, temperature = tiny(seed=3), [3, 7, 1], 20000, 1.2
    tokens, _, logps = model.generate([prompt], 1, num_samples=n, temperature=temperature,
                                      top_k=top_k, top_p=top_p,
                                      generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # the trainer's log q of every token: all V continuations of the prompt
        every = torch.tensor([prompt + [t] for t in range(V)])
        q = model.logprobs(every, torch.full((V,), 3), 1, temperature, top_k=top_k,
                           top_p=top_p)[:, 0].exp()
        z = model.logits(torch.tensor([prompt]))[0, -1] / temperature
    want = torch.tensor(expected_probs(z.tolist(), 1.0, top_k, top_p), dtype=DT)
    support = want > 0
    # q from the trainer = the enumerated q
    torch.testing.assert_close(q[support], want[support], rtol=1e-12, atol=0)
    counts = torch.bincount(tokens[:, 0], minlength=V).double()
    assert (counts[~support] == 0).all() and 1 < support.sum() < V
    chi2 = ((counts - n * q)[support] ** 2 / (n * q[support])).sum().item()
    assert chi2 < chi_square_critical(int(support.sum()) - 1), chi2
    # the sampler computes in float32
    torch.testing.assert_close(logps[:, 0].double(), q.log()[tokens[:, 0]], rtol=0, atol=1e-5)


@pytest.mark.parametrize('top_k, top_p', [(None, 0.8), (6, 0.9)])
def test_a_truncated_on_policy_step_is_the_exact_policy_gradient_of_q(top_k, top_p):
    """float64, one real step: generate samples with top_k/top_p, the trainer's log q passes
    through grpo_loss (dr_grpo, on-policy: every ratio 1) and backward; the gradient equals the
    policy gradient of q written out by hand, -sum_i A_i sum_t grad log q(o_it) / (B C) with q
    enumerated per position, to 1e-12; the full softmax's (truncate_logprobs=False) does not."""
    model, C, G, temperature = tiny(vocab=24, seed=5), 6, 4, 0.9
    prompts = [[5, 9, 2], [7, 7], [1, 2, 3, 4]]
    tokens, mask, sampler_logps = (t.clone() for t in model.generate(
        prompts, C, num_samples=G, temperature=temperature, top_k=top_k, top_p=top_p,
        eos_id=[20, 21], generator=torch.Generator().manual_seed(6)))
    idx, start = pack([p for p in prompts for _ in range(G)], tokens.tolist(), 20)
    L = tokens.shape[1]
    rewards = torch.tensor([1., 0, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0], dtype=DT)
    advantages = group_advantages(rewards, G, 'none')

    def step(**cut):
        return grpo_loss(model(idx, start, L, temperature, **cut), None, None, advantages, mask,
                         loss_type='dr_grpo', max_completion_length=C,
                         sampler_logps=sampler_logps.to(DT))
    loss, stats = step(top_k=top_k, top_p=top_p)
    # the sampler reported this log q
    assert stats['ratio/max'].item() == 1 and stats['sampler/logp_diff'].item() < 1e-5
    logq = loop_logq(model, idx, start, L, temperature, top_k, top_p)[0]
    for b in range(len(idx)):  # every sampled token lies in the kept set the loop enumerates
        for j in range(int(mask[b].sum())):
            z = (model.logits(idx[b:b + 1])[0, start[b] + j - 1] / temperature).tolist()
            assert expected_probs(z, 1.0, top_k, top_p)[int(idx[b, start[b] + j])] > 0
    pg = -(advantages[:, None] * torch.where(mask, logq, 0.0)).sum() / (len(idx) * C)
    want, got = grads(pg, model), grads(loss, model)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert want.norm() > 1e-3
    full, full_stats = step()  # the full softmax: another gradient, a gap to the sampler's log q
    assert (grads(full, model) - want).abs().max() > 1e-4
    assert full_stats['sampler/logp_diff'].item() > 1e-2


def test_the_gap_is_logged_and_shows_the_full_softmax_off_policy(tmp_path):
    """train.py with top_p: log q on both sides, the logged gap is float32 rounding; the full
    softmax's (truncate_logprobs=False) reads the kept mass the sampler dropped, and so does its k3
    KL; off-policy (mu = 2) the full softmax's old log-probs are the trainer's own."""
    gaps = {}
    for truncate in (True, False):
        out = tmp_path / str(truncate)
        p = run(['config/dr_grpo.py', '--max_iters=2', '--top_p=0.7', '--num_iterations=2',
                 f'--truncate_logprobs={truncate}'], out)
        rows = [m for m in metrics(out) if 'reward' in m]
        assert 'sampler gap' in p.stdout
        assert all(m['ratio/mean'] == m['ratio/mean'] for m in rows)  # not NaN
        gaps[truncate] = [(m['sampler/logp_diff'], m['sampler/kl']) for m in rows]
    assert all(d < 1e-4 and 0 <= kl < 1e-8 for d, kl in gaps[True]), gaps
    assert all(d > 0.05 and kl > 1e-3 for d, kl in gaps[False]), gaps
