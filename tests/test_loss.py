"""
Tests for loss.py. The reference implementations below are written from the papers' equations with Python loops
over sequences and tokens in float64, sharing no code with loss.py's vectorised version; gradients come from
torch.autograd on a float64 leaf `logps`. GSPO's reference is the paper's sequence-level objective (gradient through
the sequence mean), which must give the same gradient as loss.py's per-token form.
"""

import itertools
import math
import os
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss import LOSS_TYPES, grpo_loss, group_advantages, kl_divergence  # noqa: E402

DT = torch.float64
NAN = float("nan")


def make_batch(seed, B=5, T=6, spread=0.4):
    """Random ragged batch with one full row, a one-token row and an all-masked row; garbage in the padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = True
    mask[1] = False
    mask[1, 2] = True  # a one-token row
    mask[2] = False  # an all-masked row
    logps = -2 * torch.rand(B, T, generator=g, dtype=DT)
    old = logps + spread * torch.randn(B, T, generator=g, dtype=DT)
    ref = logps + 0.3 * torch.randn(B, T, generator=g, dtype=DT)
    # padding that would overflow exp (or make inf * 0 = NaN) if it were not masked before use
    old = torch.where(mask, old, -1000.0)
    ref = torch.where(mask, ref, 1000.0)
    adv = torch.randn(B, generator=g, dtype=DT)
    return logps, old, ref, adv, mask


def reference_loss(logps, old, ref, adv, mask, loss_type="grpo", beta=0.0, eps_low=0.2, eps_high=0.2, delta=None,
                   surrogate="clip", level="token", kl_estimator="k3", L=None, N=None, num_tokens=None):
    """Brute force: one Python loop over sequences, one over their valid tokens; returns (loss, stats)."""
    B, T = logps.shape
    L = T if L is None else L
    N = B if N is None else N
    rows = [[t for t in range(T) if mask[i, t]] for i in range(B)]
    micro_tokens = sum(len(toks) for toks in rows)
    num_tokens = micro_tokens if num_tokens is None else num_tokens
    loss = logps.sum() * 0  # keeps the graph connected even when every term is a constant
    kls, lows, highs, ratios = [], [], [], []
    for i, toks in enumerate(rows):
        A = adv[i].item()
        olds = [logps[i, t].detach() if old is None else old[i, t] for t in toks]
        if level == "sequence" and toks:  # GSPO: s_i = exp(mean_t log(pi / pi_old)), differentiated through
            s = torch.exp(sum(logps[i, t] - o for t, o in zip(toks, olds)) / len(toks))
        token_sum = 0.0
        for t, o in zip(toks, olds):
            r = s if level == "sequence" else torch.exp(logps[i, t] - o)
            if surrogate == "clip":
                clipped = max(min(r, 1 + eps_high), 1 - eps_low)
                capped = r if delta is None else min(r, delta)
                term = -min(capped * A, clipped * A)
                lows.append(r.item() < 1 - eps_low and A < 0)
                highs.append(r.item() > 1 + eps_high and A > 0)
            else:
                term = -min(r.item(), eps_high) * A * logps[i, t]
                lows.append(False)
                highs.append(r.item() > eps_high)
            ratios.append(r.item())
            if ref is not None:
                x = ref[i, t] - logps[i, t]
                kl = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - x - 1}[kl_estimator]
                kls.append(kl.item())
                term = term + beta * kl
            token_sum = token_sum + term
        n = len(toks)
        if n == 0:
            continue
        if loss_type == "grpo":
            loss = loss + token_sum / n / N
        elif loss_type == "bnpo":
            loss = loss + token_sum / micro_tokens * (B / N)
        elif loss_type == "dr_grpo":
            loss = loss + token_sum / (N * L)
        elif loss_type == "dapo":
            loss = loss + token_sum / num_tokens
        else:  # luspo: (token-mean sequence loss) x length, averaged over sequences
            loss = loss + (token_sum / n) * n / N
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    stats = {"kl": mean(kls), "clip_ratio/low": mean(lows), "clip_ratio/high": mean(highs),
             "clip_ratio/region": mean([lo or hi for lo, hi in zip(lows, highs)]),
             "ratio/mean": mean(ratios), "ratio/max": max(ratios, default=0.0)}
    return loss, stats


def loss_and_grad(fn, logps, *args, **kwargs):
    """Value and d/dlogps of fn(logps, ...)[0] with logps as a fresh float64 leaf."""
    leaf = logps.clone().requires_grad_(True)
    out = fn(leaf, *args, **kwargs)
    loss, stats = out if isinstance(out, tuple) else (out, None)
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    return loss.detach(), torch.zeros_like(leaf) if grad is None else grad, stats


# ----------------------------------------------------------------------------------------------------------------
# every combination against the brute force

CLIP_SETTINGS = [("clip", None, 0.2, 0.28), ("clip", 1.3, 0.2, 0.28), ("cispo", None, 0.2, 1.1)]


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("beta,kl_estimator", list(itertools.product([0.0, 0.1], ["k1", "k2", "k3"])))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("surrogate,delta,eps_low,eps_high", CLIP_SETTINGS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_brute_force(loss_type, surrogate, delta, eps_low, eps_high, level, beta, kl_estimator, on_policy):
    logps, old, ref, adv, mask = make_batch(seed=0)
    old = None if on_policy else old
    kw = dict(loss_type=loss_type, beta=beta, delta=delta, surrogate=surrogate, kl_estimator=kl_estimator)
    loss, grad, stats = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, epsilon_low=eps_low,
                                      epsilon_high=eps_high, importance_sampling_level=level, **kw)
    ref_loss, ref_grad, ref_stats = loss_and_grad(reference_loss, logps, old, ref, adv, mask, eps_low=eps_low,
                                                  eps_high=eps_high, level=level, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()  # padding and the all-masked row get exactly zero gradient
    for name, value in ref_stats.items():
        assert stats[name].requires_grad is False and stats[name].dim() == 0
        assert stats[name].item() == pytest.approx(value, rel=1e-10, abs=1e-12), name


def test_all_masked_row_alone_gives_zero_loss_and_gradient():
    logps, old, ref, adv, mask = make_batch(seed=1)
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            loss, grad, _ = loss_and_grad(grpo_loss, logps[2:3], old[2:3], ref[2:3], adv[2:3], mask[2:3], beta=0.1,
                                          loss_type=loss_type, importance_sampling_level=level)
            assert loss.item() == 0 and (grad == 0).all()


def test_float_mask_is_the_same_as_bool_mask():
    logps, old, ref, adv, mask = make_batch(seed=14)
    kw = dict(beta=0.1, loss_type="dapo", importance_sampling_level="sequence")
    loss_b, grad_b, _ = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, **kw)
    loss_f, grad_f, _ = loss_and_grad(grpo_loss, logps, old, ref, adv, mask.float(), **kw)
    assert loss_b == loss_f and torch.equal(grad_b, grad_f)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch_is_zero_not_nan(loss_type):
    logps, old, ref, adv, mask = make_batch(seed=2)
    mask = torch.zeros_like(mask, dtype=DT)  # float masks work too
    loss, grad, stats = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, beta=0.1, loss_type=loss_type)
    assert loss.item() == 0 and (grad == 0).all()
    assert all(v.item() == 0 for v in stats.values())


# ----------------------------------------------------------------------------------------------------------------
# the claims people argue about

@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_gradient_is_the_policy_gradient_plus_kl(level):
    logps, _, ref, adv, mask = make_batch(seed=3)
    beta = 0.05

    ref, m = torch.where(mask, ref, 0.0), mask.to(DT)  # the padding's ref_logps would overflow exp here

    def plain(lp):  # -A log pi per token plus beta k3, then mean over tokens, mean over sequences
        per_token = -adv[:, None] * lp + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()

    _, grad, stats = loss_and_grad(grpo_loss, logps, None, ref, adv, mask, beta=beta, epsilon_low=0.01,
                                   epsilon_high=0.01, importance_sampling_level=level)
    _, want, _ = loss_and_grad(plain, logps)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)
    assert stats["ratio/mean"].item() == 1 and stats["ratio/max"].item() == 1
    assert stats["clip_ratio/region"].item() == 0  # even with eps = 0.01 the clip never fires at r = 1


@pytest.mark.parametrize("on_policy", [False, True])
def test_dr_grpo_is_sum_over_tokens_mean_over_sequences_divided_by_max_completion_length(on_policy):
    logps, old, ref, adv, mask = make_batch(seed=4)
    old = None if on_policy else old
    L, m = 16, mask.to(DT)
    _, dr, _ = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, loss_type="dr_grpo", max_completion_length=L)
    _, luspo, _ = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, loss_type="luspo")
    torch.testing.assert_close(dr * L, luspo, rtol=1e-12, atol=1e-14)
    if on_policy:  # and both equal the hand-written "sum over tokens, mean over sequences" policy gradient
        _, want, _ = loss_and_grad(lambda lp: (-adv[:, None] * lp * m).sum(-1).mean(), logps)
        torch.testing.assert_close(luspo, want, rtol=1e-12, atol=1e-14)


def test_grpo_weights_short_sequences_more_and_dapo_does_not():
    T = 6
    logps = -torch.rand(2, T, dtype=DT)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, 2:] = False  # a 2-token sequence next to a 6-token one, same advantage
    adv = torch.tensor([1.0, 1.0], dtype=DT)
    _, g_grpo, _ = loss_and_grad(grpo_loss, logps, None, None, adv, mask, loss_type="grpo")
    _, g_dapo, _ = loss_and_grad(grpo_loss, logps, None, None, adv, mask, loss_type="dapo")
    assert g_grpo[0, 0].item() == pytest.approx(3 * g_grpo[1, 0].item(), rel=1e-12)  # 1/2 vs 1/6 per token
    assert g_dapo[0, 0].item() == pytest.approx(g_dapo[1, 0].item(), rel=1e-12)
    assert (g_dapo[mask] == g_dapo[0, 0]).all()


def test_k3_is_nonnegative_and_its_gradient_is_the_closed_form():
    g = torch.Generator().manual_seed(5)
    logps = -3 * torch.rand(50, 20, generator=g, dtype=DT)
    ref = -3 * torch.rand(50, 20, generator=g, dtype=DT)
    ref[0] = logps[0]
    kl = kl_divergence(logps, ref, "k3")
    assert (kl >= 0).all() and (kl[0] == 0).all()
    _, grad, _ = loss_and_grad(lambda lp: kl_divergence(lp, ref, "k3").sum(), logps)
    torch.testing.assert_close(grad, 1 - torch.exp(ref - logps), rtol=1e-12, atol=1e-14)  # d/dlogp of the closed form
    assert torch.isfinite(kl_divergence(torch.tensor([-500.0]), torch.tensor([0.0]))).all()  # clamped, no overflow


def test_kl_estimators_expectations_match_the_docstring():
    # exact expectations over a small vocabulary, sampling from q = pi_theta; p = pi_ref
    g = torch.Generator().manual_seed(6)
    theta = torch.randn(7, generator=g, dtype=DT, requires_grad=True)
    logp_ref = torch.log_softmax(torch.randn(7, generator=g, dtype=DT), -1)
    logq = torch.log_softmax(theta, -1)
    q, p = logq.exp(), logp_ref.exp()

    def expected_grad(estimator):  # E_{x~q}[grad k(x)], the sampling distribution itself not differentiated
        return torch.autograd.grad((q.detach() * kl_divergence(logq, logp_ref, estimator)).sum(), theta,
                                   retain_graph=True)[0]

    reverse_kl = (q * (logq - logp_ref)).sum()
    forward_kl = (p * (logp_ref - logq)).sum()
    for estimator in ("k1", "k3"):  # unbiased
        value = (q * kl_divergence(logq, logp_ref, estimator)).sum()
        assert value.item() == pytest.approx(reverse_kl.item(), rel=1e-12)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros(7, dtype=DT), rtol=0, atol=1e-14)
    torch.testing.assert_close(expected_grad("k2"), torch.autograd.grad(reverse_kl, theta, retain_graph=True)[0])
    torch.testing.assert_close(expected_grad("k3"), torch.autograd.grad(forward_kl, theta, retain_graph=True)[0])


def test_clip_binds_only_where_it_should():
    logps, old, _, adv, mask = make_batch(seed=7, B=40, T=8, spread=0.5)
    adv[::2] = -adv[::2].abs()
    adv[1::2] = adv[1::2].abs()
    eps_low, eps_high = 0.2, 0.28
    _, grad, stats = loss_and_grad(grpo_loss, logps, old, None, adv, mask, loss_type="dapo", epsilon_low=eps_low,
                                   epsilon_high=eps_high)
    r, A = torch.exp(logps - old), adv[:, None].expand_as(logps)
    low, high = mask & (r < 1 - eps_low) & (A < 0), mask & (r > 1 + eps_high) & (A > 0)
    assert low.any() and high.any() and (mask & (r > 1 + eps_high) & (A < 0)).any()  # every case is present
    assert (grad[low | high] == 0).all()
    assert (grad[mask & ~(low | high)] != 0).all()
    n = mask.sum().item()
    assert stats["clip_ratio/low"].item() == pytest.approx(low.sum().item() / n)
    assert stats["clip_ratio/high"].item() == pytest.approx(high.sum().item() / n)
    assert stats["clip_ratio/region"].item() == pytest.approx((low | high).sum().item() / n)


def test_kl_in_reward_changes_advantages_not_the_per_token_loss():
    logps, old, ref, adv, mask = make_batch(seed=8, B=6)
    G, beta = 3, 0.5
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=DT)
    kl_per_sequence = (kl_divergence(logps, ref) * mask).sum(-1)  # (B,)
    adv_plain = group_advantages(rewards, G)
    adv_kl = group_advantages(rewards - beta * kl_per_sequence, G)
    assert not torch.allclose(adv_plain, adv_kl)
    # with beta=0 the loss is the surrogate alone: the reference model has no say in it, only the advantages do
    loss, grad, _ = loss_and_grad(grpo_loss, logps, old, ref, adv_kl, mask)
    loss_no_ref, grad_no_ref, _ = loss_and_grad(grpo_loss, logps, old, None, adv_kl, mask)
    ref_loss, ref_grad, _ = loss_and_grad(reference_loss, logps, old, None, adv_kl, mask)
    assert loss == loss_no_ref and torch.equal(grad, grad_no_ref)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# micro-batching

def split_grads(k, logps, old, ref, adv, mask, **kw):
    """Sum of the micro-batch gradients, each micro-batch trimmed to its own longest row as a trainer would."""
    B, T = logps.shape
    total = torch.zeros_like(logps)
    for rows in torch.arange(B).chunk(k):
        t = max(int(mask[rows].nonzero()[:, 1].max()) + 1, 1) if mask[rows].any() else 1
        _, grad, _ = loss_and_grad(grpo_loss, logps[rows, :t], old[rows, :t], ref[rows, :t], adv[rows],
                                   mask[rows, :t], num_sequences=B, num_tokens=int(mask.sum()),
                                   max_completion_length=T, **kw)
        total[rows, :t] += grad
    return total


@pytest.mark.parametrize("k", [2, 3, 6])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo"])
def test_split_invariance(loss_type, level, k):
    logps, old, ref, adv, mask = make_batch(seed=9, B=6, T=7)
    mask[5, 3:] = False  # a short row at the end so trimming changes T for that micro-batch
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1, epsilon_high=0.28)
    _, whole, _ = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, **kw)
    torch.testing.assert_close(split_grads(k, logps, old, ref, adv, mask, **kw), whole, rtol=0, atol=1e-6)


def test_bnpo_is_the_mean_of_micro_batch_token_means():
    logps, old, ref, adv, mask = make_batch(seed=10, B=6, T=7)
    k = 3
    summed = split_grads(k, logps, old, ref, adv, mask, loss_type="bnpo")
    want = torch.zeros_like(logps)
    for rows in torch.arange(6).chunk(k):  # each micro-batch's token mean, averaged over the k micro-batches
        _, g, _ = loss_and_grad(reference_loss, logps[rows], old[rows], ref[rows], adv[rows], mask[rows],
                                loss_type="dapo")
        want[rows] = g / k
    torch.testing.assert_close(summed, want, rtol=1e-10, atol=1e-12)
    _, whole, _ = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, loss_type="bnpo")
    assert not torch.allclose(summed, whole)  # unlike dapo, it depends on the split


# ----------------------------------------------------------------------------------------------------------------
# advantages

def reference_advantages(rewards, G, scale):
    """statistics-module reference: NaN rewards are left out and get 0; std is the sample std."""
    rewards = rewards.tolist()
    valid_all = [x for x in rewards if not math.isnan(x)]
    batch_std = statistics.stdev(valid_all) if len(valid_all) > 1 else 0.0
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        valid = [x for x in group if not math.isnan(x)]
        mean = statistics.mean(valid) if valid else 0.0
        std = {"group": statistics.stdev(valid) if len(valid) > 1 else 0.0, "batch": batch_std, "none": None}[scale]
        for x in group:
            out.append(0.0 if math.isnan(x) else (x - mean) if std is None else (x - mean) / (std + 1e-4))
    return torch.tensor(out, dtype=DT)


def test_advantages_two_completions_zero_one():
    adv = group_advantages(torch.tensor([0.0, 1.0], dtype=DT), 2)
    half = 0.5 / (math.sqrt(0.5) + 1e-4)  # sample std of {0, 1} is sqrt(1/2)
    torch.testing.assert_close(adv, torch.tensor([-half, half], dtype=DT))
    assert adv[1].item() == pytest.approx(0.707, abs=1e-3)


def test_advantages_none_rewards_are_left_out():
    rewards = torch.tensor([1.0, NAN, 3.0, 5.0, NAN, NAN, 2.0, NAN], dtype=DT)
    adv = group_advantages(rewards, 4)
    d = 2 / (2 + 1e-4)  # group one is {1, 3, 5}: mean 3, sample std 2; group two has one reward: no spread
    torch.testing.assert_close(adv, torch.tensor([-d, 0, 0, d, 0, 0, 0, 0], dtype=DT))


def test_advantages_all_equal_groups_are_zero_not_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, NAN, NAN, NAN], dtype=DT)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, 3, scale)
        assert (adv == 0).all(), scale


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_scaling_matches_reference(scale):
    g = torch.Generator().manual_seed(11)
    rewards = torch.randn(24, generator=g, dtype=DT)
    rewards[torch.rand(24, generator=g) < 0.25] = NAN
    rewards[8:12] = torch.tensor([NAN, NAN, NAN, 2.0], dtype=DT)  # a group with a single reward
    torch.testing.assert_close(group_advantages(rewards, 4, scale), reference_advantages(rewards, 4, scale))


def test_batch_scaling_differs_from_group_scaling():
    rewards = torch.tensor([0.0, 1.0, 0.0, 10.0], dtype=DT)
    group, batch, none = (group_advantages(rewards, 2, s) for s in ("group", "batch", "none"))
    torch.testing.assert_close(none, torch.tensor([-0.5, 0.5, -5.0, 5.0], dtype=DT))
    assert group[1].item() == pytest.approx(group[3].item(), rel=1e-3)  # each group normalised by its own spread
    assert batch[3].item() == pytest.approx(10 * batch[1].item(), rel=1e-12)  # one spread for all keeps the scale


# ----------------------------------------------------------------------------------------------------------------
# bad input

@pytest.mark.parametrize("kw,words", [
    (dict(loss_type="ppo"), "grpo, bnpo, dr_grpo, dapo, luspo"),
    (dict(surrogate="sapo"), "clip, cispo"),
    (dict(importance_sampling_level="seq"), "token, sequence"),
    (dict(kl_estimator="k4"), "k1, k2, k3"),
])
def test_unknown_choices_list_the_valid_ones(kw, words):
    logps, old, ref, adv, mask = make_batch(seed=12)
    with pytest.raises(ValueError, match=words):
        grpo_loss(logps, old, ref, adv, mask, **kw)


def test_bad_input_is_a_clear_error():
    logps, old, _, adv, mask = make_batch(seed=13)
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, old, None, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="shapes"):
        grpo_loss(logps, old, None, adv[:-1], mask)
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(torch.zeros(4), 2, "std")


def test_is_flat_for_any_group_size():
    """A flat group (all rewards equal, NaN counted as 0) has zero advantage; with G = 1 every group is flat."""
    from rollout import is_flat
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, float('nan'), 0.0], dtype=torch.float64)
    assert is_flat(r, 2).tolist() == [True, False, True]
    assert is_flat(r, 3).tolist() == [False, False]
    assert is_flat(r, 1).tolist() == [True] * 6
    assert is_flat(torch.zeros(4), 4).tolist() == [True]
