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
from loss import (LOSS_TYPES, decoupled_advantages, decoupled_loss, entropy_threshold, grpo_loss,  # noqa: E402
                  group_advantages, kl_divergence, truncated_is_loss)
from configurator import check_loss  # noqa: E402

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


def sampler_of(old, seed, spread=0.3):
    """Log-probs a sampler might have reported for the same tokens: the trainer's plus noise; garbage in padding."""
    g = torch.Generator().manual_seed(seed)
    return torch.where(old > -1000, old + spread * torch.randn(old.shape, generator=g, dtype=DT), 1000.0)


def toy_entropy(logps):
    """A differentiable stand-in for each token's entropy (the real one comes from the model's output layer)."""
    return -0.7 * logps + 0.1 * logps ** 2


def reference_loss(logps, old, ref, adv, mask, loss_type="grpo", beta=0.0, eps_low=0.2, eps_high=0.2, delta=None,
                   surrogate="clip", level="token", kl_estimator="k3", L=None, N=None, num_tokens=None,
                   sapo_temps=(1.0, 1.05), vespo_pos=(2.0, 3.0), vespo_neg=(3.0, 2.0), iw_kl=False, sampler=None,
                   off_policy=None, correction="none", clip_min=None, clip_max=3.0, entropy_coef=0.0, keep=None,
                   gspo_token=False):
    """Brute force: one Python loop over sequences, one over their valid tokens; returns (loss, stats). At the
    sequence level, the ratio is GSPO's s_i differentiated through its mean, or with gspo_token GSPO-token's
    sg(s_i) pi / sg(pi), whose gradient reaches only the tokens whose terms count."""
    B, T = logps.shape
    L = T if L is None else L
    N = B if N is None else N
    rows = [[t for t in range(T) if mask[i, t]] for i in range(B)]
    micro_tokens = sum(len(toks) for toks in rows)
    num_tokens = micro_tokens if num_tokens is None else num_tokens
    loss = logps.sum() * 0  # keeps the graph connected even when every term is a constant
    kls, lows, highs, ratios, entropies, dropped, weights = [], [], [], [], [], [], []
    for i, toks in enumerate(rows):
        olds = [logps[i, t].detach() if old is None else old[i, t] for t in toks]
        samplers = [o.item() if sampler is None else sampler[i, t].item() for t, o in zip(toks, olds)]
        if level == "sequence" and toks:  # GSPO: s_i = exp(mean_t log(pi / pi_old)), differentiated through
            s = torch.exp(sum(logps[i, t] - o for t, o in zip(toks, olds)) / len(toks))
        drift = sum(sp - logps[i, t].item() for t, sp in zip(toks, samplers)) / max(len(toks), 1)
        # VESPO: w = prod_t pi / pi_old (each log-ratio clamped to +-20, the sum to [log 1e-8, 20]), a plain float
        log_w = min(max(sum(min(max(logps[i, t].item() - o.item(), -20), 20) for t, o in zip(toks, olds)),
                        math.log(1e-8)), 20)
        seq_rho = math.exp(sum(o.item() - sp for o, sp in zip(olds, samplers)))  # prod_t pi_old / pi_sampler
        token_sum = 0.0
        for t, o, sp in zip(toks, olds, samplers):
            A = (adv[i, t] if adv.dim() == 2 else adv[i]).item()  # the sequence's, or the token's own
            # DeepSeek-V3.2 eq. 9: a negative sample the sampler drew from a policy that drifted too far is left out
            drop = off_policy is not None and A < 0 and drift > off_policy
            k, lam = vespo_pos if A >= 0 else vespo_neg
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            r = torch.exp(logps[i, t] - o)
            if level == "sequence":  # GSPO-token (sec. 4.3): the same gradient, unless tokens are weighted unequally
                r = s.detach() * torch.exp(logps[i, t] - logps[i, t].detach()) if gspo_token else s
            if surrogate == "clip":
                clipped = max(min(r, 1 + eps_high), 1 - eps_low)
                capped = r if delta is None else min(r, delta)
                term = -min(capped * A, clipped * A)
                lows.append(r.item() < 1 - eps_low and A < 0)
                highs.append(r.item() > 1 + eps_high and A > 0)
            else:
                if surrogate == "cispo":
                    term = -min(r.item(), eps_high) * A * logps[i, t]
                elif surrogate == "sapo":
                    tau = sapo_temps[0] if A > 0 else sapo_temps[1]
                    term = -4 / tau * torch.sigmoid(tau * (r - 1)) * A
                else:
                    term = -phi * A * logps[i, t]
                lows.append(False)
                highs.append(surrogate == "cispo" and r.item() > eps_high)
            if correction != "none":  # TIS / MIS: rho = pi_old / pi_sampler, per token or for the whole sequence
                rho = seq_rho if correction.startswith("sequence") else math.exp(o.item() - sp)
                lo = 0.0 if clip_min is None else clip_min
                rho = min(max(rho, lo), clip_max) if correction.endswith("truncate") else \
                    rho if lo <= rho <= clip_max else 0.0
                weights.append(rho)
                term = term * rho
            if drop or (keep is not None and not keep[i, t]):
                term = 0.0
            ratios.append(r.item())
            dropped.append(bool(drop))
            if ref is not None:
                x = ref[i, t] - logps[i, t]
                kl = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - x - 1}[kl_estimator]
                if iw_kl:  # the token's ratio, whatever the surrogate's level
                    kl = torch.exp(logps[i, t] - o) * kl
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
        for t in toks:
            entropies.append(toy_entropy(logps[i, t]))
            loss = loss - entropy_coef * entropies[-1] / num_tokens
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    stats = {"kl": mean(kls), "clip_ratio/low": mean(lows), "clip_ratio/high": mean(highs),
             "clip_ratio/region": mean([lo or hi for lo, hi in zip(lows, highs)]),
             "ratio/mean": mean(ratios), "ratio/max": max(ratios, default=0.0),
             "entropy": mean([e.item() for e in entropies])}
    if sampler is not None:
        gaps = [o.item() - sampler[i, t].item() for i, toks in enumerate(rows) for t, o in
                zip(toks, [logps[i, t].detach() if old is None else old[i, t] for t in toks])]
        stats["sampler/logp_diff"] = mean([abs(x) for x in gaps])
        stats["sampler/rho_max"] = max((math.exp(x) for x in gaps), default=0.0)
        stats["sampler/kl"] = mean([math.exp(x) - x - 1 for x in gaps])  # k3, the sampler's tokens
    if off_policy is not None:
        stats["off_policy_masked"] = mean(dropped)
    if correction != "none":
        stats["sampler_correction/weight"] = mean(weights)
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
    check_against_reference(logps, old, ref, adv, mask, dict(epsilon_low=eps_low, epsilon_high=eps_high,
                            importance_sampling_level=level, **kw), dict(eps_low=eps_low, eps_high=eps_high,
                            level=level, **kw))


def ours_with_entropy(lp, *args, **kwargs):
    return grpo_loss(lp, *args, entropy=toy_entropy(lp), **kwargs)


def check_against_reference(logps, old, ref, adv, mask, ours, reference):
    """grpo_loss(**ours) and reference_loss(**reference): the same loss, gradient and stats; no NaN, and exactly
    zero gradient on padding and on the all-masked row."""
    loss, grad, stats = loss_and_grad(ours_with_entropy, logps, old, ref, adv, mask, **ours)
    ref_loss, ref_grad, ref_stats = loss_and_grad(reference_loss, logps, old, ref, adv, mask, **reference)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()  # padding and the all-masked row get exactly zero gradient
    assert stats.keys() == ref_stats.keys()
    for name, value in ref_stats.items():
        assert stats[name].requires_grad is False and stats[name].dim() == 0
        assert stats[name].item() == pytest.approx(value, rel=1e-10, abs=1e-12), name


# (name, grpo_loss's keywords, the reference's): each knob of the second wave alone, then all of them together
KEEP = torch.rand(5, 6, generator=torch.Generator().manual_seed(21)) < 0.5
KNOBS = [
    ("sapo", dict(surrogate="sapo"), dict(surrogate="sapo")),
    ("sapo temperatures", dict(surrogate="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=3.0),
     dict(surrogate="sapo", sapo_temps=(0.5, 3.0))),
    ("vespo", dict(surrogate="vespo"), dict(surrogate="vespo")),
    ("vespo shapes", dict(surrogate="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                          vespo_lambda_neg=1.0), dict(surrogate="vespo", vespo_pos=(1.5, 0.5), vespo_neg=(4.0, 1.0))),
    ("importance-weighted kl", dict(use_bias_correction_kl=True, beta=0.1), dict(iw_kl=True, beta=0.1)),
    ("off-policy mask", dict(off_policy_mask_threshold=0.02), dict(off_policy=0.02)),
    ("entropy mask", dict(entropy_mask=KEEP), dict(keep=KEEP)),
    ("entropy bonus", dict(entropy_coef=0.3), dict(entropy_coef=0.3)),
] + [(mode, dict(sampler_correction=mode, sampler_correction_clip_min=lo, sampler_correction_clip_max=hi),
      dict(correction=mode, clip_min=lo, clip_max=hi))
     for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
     for lo, hi in ((None, 1.2), (0.8, 1.1))] + [
    ("all at once", dict(surrogate="sapo", use_bias_correction_kl=True, beta=0.1, off_policy_mask_threshold=0.0,
                         entropy_mask=KEEP, entropy_coef=0.3, sampler_correction="token_mask",
                         sampler_correction_clip_min=0.7),
     dict(surrogate="sapo", iw_kl=True, beta=0.1, off_policy=0.0, keep=KEEP, entropy_coef=0.3, correction="token_mask",
          clip_min=0.7)),
]


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("name,ours,reference", KNOBS, ids=[k[0] for k in KNOBS])
def test_second_wave_matches_brute_force(name, ours, reference, loss_type, level, on_policy):
    logps, old, ref, adv, mask = make_batch(seed=20)
    sampler = sampler_of(old, seed=22)
    old = None if on_policy else old
    common = dict(loss_type=loss_type, beta=0.05, delta=1.5)
    check_against_reference(logps, old, ref, adv, mask, dict(common, importance_sampling_level=level, epsilon_high=0.28,
                            sampler_logps=sampler, **ours), dict(common, level=level, eps_high=0.28, sampler=sampler,
                                                                 gspo_token=True, **reference))


# ----------------------------------------------------------------------------------------------------------------
# per-token advantages (on-policy distillation's): (B, T) instead of (B,), through every setting

def token_advantages(adv, mask, seed):
    """(B, T) advantages: each sequence's plus a token's own of either sign, so that the sign flips within a row;
    large garbage on padding, which must not reach the loss or its gradient."""
    g = torch.Generator().manual_seed(seed)
    per_token = adv[:, None] + torch.randn(mask.shape, generator=g, dtype=DT)
    return torch.where(mask, per_token, 50.0)


FIRST_WAVE = [(f"{surrogate} delta={delta}", dict(surrogate=surrogate, delta=delta, epsilon_low=low, epsilon_high=high),
               dict(surrogate=surrogate, delta=delta, eps_low=low, eps_high=high))
              for surrogate, delta, low, high in CLIP_SETTINGS]


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("name,ours,reference", FIRST_WAVE + KNOBS, ids=[k[0] for k in FIRST_WAVE + KNOBS])
def test_per_token_advantages_match_brute_force(name, ours, reference, loss_type, level, on_policy):
    """The brute force with A_it in place of A_i: each token's own sign picks its clip side, SAPO temperature,
    VESPO shape and whether the off-policy mask drops it; GSPO-token weighs each token by its own advantage."""
    logps, old, ref, adv, mask = make_batch(seed=30)
    adv = token_advantages(adv, mask, seed=31)
    sampler = sampler_of(old, seed=32)
    old = None if on_policy else old
    common = dict(loss_type=loss_type, beta=0.05)
    ours = dict(dict(common, importance_sampling_level=level, sampler_logps=sampler, delta=1.5,
                     epsilon_high=0.28), **ours)
    reference = dict(dict(common, level=level, sampler=sampler, gspo_token=True, delta=1.5, eps_high=0.28),
                     **reference)
    check_against_reference(logps, old, ref, adv, mask, ours, reference)


@pytest.mark.parametrize("name,knobs", [k[:2] for k in FIRST_WAVE + KNOBS])
def test_sequence_advantages_are_token_advantages_repeated(name, knobs):
    """An advantage A_i (B,) and the same A_i on each of its tokens (B, T): bitwise the same loss, gradient and
    stats, on every loss type and level."""
    logps, old, ref, adv, mask = make_batch(seed=33)
    sampler = sampler_of(old, seed=34)
    for loss_type, level in itertools.product(LOSS_TYPES, ("token", "sequence")):
        kw = dict(dict(loss_type=loss_type, importance_sampling_level=level, beta=0.05, sampler_logps=sampler),
                  **knobs)
        a = loss_and_grad(ours_with_entropy, logps, old, ref, adv, mask, **kw)
        b = loss_and_grad(ours_with_entropy, logps, old, ref, adv[:, None].expand(mask.shape), mask, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (loss_type, level)
        assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


@pytest.mark.parametrize("name,knobs", [("first wave", {})] + [k[:2] for k in KNOBS])
def test_all_masked_row_alone_gives_zero_loss_and_gradient(name, knobs):
    logps, old, ref, adv, mask = make_batch(seed=1)
    knobs = {k: v[2:3] if torch.is_tensor(v) else v for k, v in knobs.items()}  # entropy_mask's row too
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            loss, grad, stats = loss_and_grad(ours_with_entropy, logps[2:3], old[2:3], ref[2:3], adv[2:3],
                                              mask[2:3], **dict(dict(beta=0.1, loss_type=loss_type,
                                              importance_sampling_level=level, sampler_logps=old[2:3]), **knobs))
            assert loss.item() == 0 and (grad == 0).all()
            assert all(math.isfinite(v.item()) for v in stats.values())


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


@pytest.mark.parametrize("tau", [1.0, 1.05, 4.0])
def test_sapo_gate_is_ppo_at_r_1_and_fades_smoothly(tau):
    """SAPO's gradient is PPO's unclipped one, r A grad logp, times a gate 4 sig (1 - sig) of tau (r - 1): 1 at r = 1,
    where it equals the clipped surrogate's gradient, then decreasing smoothly on both sides, never a cliff to 0."""
    r = torch.tensor([0.25, 0.5, 0.8, 0.95, 1.0, 1.05, 1.2, 1.5, 2.0, 4.0], dtype=DT)
    logps, mask = torch.log(r)[None], torch.ones(1, len(r), dtype=torch.bool)  # old_logps = 0, so the ratio is r
    for A in (1.0, -1.0):
        adv = torch.tensor([A], dtype=DT)
        _, grad, _ = loss_and_grad(grpo_loss, logps, torch.zeros_like(logps), None, adv, mask, loss_type="luspo",
                                   surrogate="sapo", sapo_temperature_pos=tau, sapo_temperature_neg=tau)
        gate = (grad / (-A * r)).squeeze(0)  # luspo: the token sum, so each token's gradient is its own
        sig = torch.sigmoid(tau * (r - 1))
        torch.testing.assert_close(gate, 4 * sig * (1 - sig), rtol=1e-12, atol=1e-15)
        assert gate[4].item() == 1.0 and (gate > 0).all()
        assert (gate[:4].diff() > 0).all() and (gate[4:].diff() < 0).all()
    logps, _, _, adv, mask = make_batch(seed=23)  # on-policy, r = 1 everywhere: SAPO is the policy gradient
    _, sapo, _ = loss_and_grad(grpo_loss, logps, None, None, adv, mask, surrogate="sapo",
                               sapo_temperature_pos=tau, sapo_temperature_neg=tau)
    _, clip, _ = loss_and_grad(grpo_loss, logps, None, None, adv, mask)
    torch.testing.assert_close(sapo, clip, rtol=1e-12, atol=1e-15)


def test_vespo_weight_is_1_on_policy_and_passes_no_gradient():
    logps, old, _, adv, mask = make_batch(seed=24, spread=0.2)
    _, on, _ = loss_and_grad(grpo_loss, logps, None, None, adv, mask, surrogate="vespo", loss_type="dapo")
    _, clip, _ = loss_and_grad(grpo_loss, logps, None, None, adv, mask, loss_type="dapo")
    torch.testing.assert_close(on, clip, rtol=1e-12, atol=1e-15)  # w = 1, phi(1) = e^(lambda - lambda) = 1
    # off-policy, each token's gradient is -phi_i A_i / tokens: phi is a constant weight, nothing flows through it
    _, grad, _ = loss_and_grad(grpo_loss, logps, old, None, adv, mask, surrogate="vespo", loss_type="dapo")
    w = torch.exp(torch.where(mask, logps - old, 0.0).sum(-1))  # (B,) the sequence ratio, small logs: no clamps bind
    k = torch.where(adv >= 0, 2.0, 3.0).to(DT)
    lam = torch.where(adv >= 0, 3.0, 2.0).to(DT)
    phi = w ** k * torch.exp(lam * (1 - w))  # the same function written another way
    want = torch.where(mask, -(phi * adv)[:, None] / mask.sum(), 0.0)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-14)
    assert (phi[mask.any(-1)] != 1).all()


def test_importance_weighted_kl_gradient_is_unbiased_off_policy():
    """Tokens drawn from a stale policy pi_old: the mean of d(r k3) is the gradient of the exact KL(pi || pi_ref),
    where the mean of d(k3) alone is not. Monte Carlo over a 6-token vocabulary, seeded."""
    g = torch.Generator().manual_seed(25)
    V, n = 6, 200_000
    theta = torch.randn(V, generator=g, dtype=DT, requires_grad=True)
    stale = torch.log_softmax(theta.detach() + torch.randn(V, generator=g, dtype=DT), -1)
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=DT), -1)
    logq = torch.log_softmax(theta, -1)
    exact = torch.autograd.grad((logq.exp() * (logq - ref)).sum(), theta)[0]
    tokens = torch.multinomial(stale.exp(), n, replacement=True, generator=g)[:, None]  # (n, 1)
    mask, adv = torch.ones(n, 1, dtype=torch.bool), torch.zeros(n, dtype=DT)  # the KL term alone
    grads = {}
    for weighted in (True, False):
        logps = torch.log_softmax(theta, -1)[tokens]  # (n, 1)
        loss, _ = grpo_loss(logps, stale[tokens], ref[tokens], adv, mask, loss_type="dapo", beta=1.0,
                            use_bias_correction_kl=weighted)
        grads[weighted] = torch.autograd.grad(loss, theta)[0]
    assert (grads[True] - exact).abs().max() < 0.01  # the Monte Carlo error at n = 200k is ~0.002
    assert (grads[False] - exact).abs().max() > 0.05


def test_entropy_threshold_keeps_the_top_share_of_the_valid_tokens():
    g = torch.Generator().manual_seed(26)
    entropy = torch.rand(40, 30, generator=g, dtype=DT)
    mask = torch.rand(40, 30, generator=g) < 0.6
    entropy[~mask] = 100.0  # padding must not count, however high its entropy
    n = int(mask.sum())
    for rho in (0.05, 0.2, 0.5, 0.8, 1.0):
        kept = int((mask & (entropy >= entropy_threshold(entropy, mask, rho))).sum())
        assert kept == n - math.ceil((1 - rho) * (n - 1))  # linear interpolation between distinct values
        assert abs(kept - rho * n) <= 1
    assert entropy_threshold(entropy, torch.zeros_like(mask), 0.2).item() == math.inf


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_sampler_correction_with_an_identical_sampler_is_a_no_op(mode, on_policy):
    logps, old, ref, adv, mask = make_batch(seed=27)
    sampler = logps if on_policy else old  # on-policy, the trainer's old log-probs are logps itself
    old = None if on_policy else old
    plain = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, beta=0.1)
    corrected = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, beta=0.1, sampler_logps=sampler,
                              sampler_correction=mode, sampler_correction_clip_min=0.5, sampler_correction_clip_max=2)
    assert torch.equal(plain[0], corrected[0]) and torch.equal(plain[1], corrected[1])
    assert corrected[2]["sampler_correction/weight"].item() == pytest.approx(1.0, abs=0)


def test_off_policy_mask_drops_only_stale_negative_sequences():
    logps, _, _, adv, mask = make_batch(seed=28, B=8)
    adv[:4], adv[4:] = -1.0, 1.0
    drift = torch.tensor([0.0, 0.3, 0.0, 0.3] * 2, dtype=DT)  # mean log(pi_sampler / pi) of each sequence
    sampler = logps + drift[:, None]
    _, grad, stats = loss_and_grad(grpo_loss, logps, None, None, adv, mask, sampler_logps=sampler,
                                   off_policy_mask_threshold=0.1)
    dropped = torch.tensor([False, True, False, True] + [False] * 4)  # A < 0 and drift > 0.1; row 2 is empty
    assert (grad[dropped] == 0).all() and (grad[~dropped & mask.any(-1)].abs().sum(-1) > 0).all()
    assert stats["off_policy_masked"].item() == pytest.approx(mask[dropped].sum().item() / mask.sum().item())


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
        part = {k: v[rows, :t] if torch.is_tensor(v) else v for k, v in kw.items()}  # sampler_logps, entropy_mask
        _, grad, _ = loss_and_grad(ours_with_entropy, logps[rows, :t], old[rows, :t], ref[rows, :t], adv[rows],
                                   mask[rows, :t], num_sequences=B, num_tokens=int(mask.sum()),
                                   max_completion_length=T, **part)
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


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo"])
@pytest.mark.parametrize("name,ours", [k[:2] for k in KNOBS], ids=[k[0] for k in KNOBS])
def test_second_wave_split_invariance(name, ours, loss_type, level):
    logps, old, ref, adv, mask = make_batch(seed=20)
    mask[4, 3:] = False
    kw = dict(dict(beta=0.1, loss_type=loss_type, importance_sampling_level=level,
                   sampler_logps=sampler_of(old, seed=22)), **ours)
    _, whole, _ = loss_and_grad(ours_with_entropy, logps, old, ref, adv, mask, **kw)
    for k in (2, 5):
        torch.testing.assert_close(split_grads(k, logps, old, ref, adv, mask, **kw), whole, rtol=0, atol=1e-12)


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
# groups sampled some versions ago (issue 57): the decoupled objective and TIS on the ratio to the sampler

def reference_stale_loss(logps, prox, behav, adv, mask, loss_type="dr_grpo", mode="token_truncate", clip_min=None,
                         clip_max=3.0, eps=0.2):
    """Brute force from the papers' equations, a loop over sequences and one over their tokens; returns (loss,
    share of tokens whose weight the bounds changed). AReaL's decoupled PPO (prox given): -w min(r A, clip(r) A),
    r = pi / pi_prox, w = pi_prox / pi_behav bounded. TIS (prox None): the same with pi_prox = sg(pi), i.e.
    -sg(w) A pi / sg(pi), w = pi / pi_behav bounded."""
    B, T = logps.shape
    rows = [[t for t in range(T) if mask[i, t]] for i in range(B)]
    tokens = sum(map(len, rows))
    low = 0.0 if clip_min is None else clip_min
    loss, clipped = logps.sum() * 0, 0
    for i, toks in enumerate(rows):
        A = adv[i].item()
        pis = [logps[i, t].item() if prox is None else prox[i, t].item() for t in toks]
        seq_w = math.exp(sum(p - behav[i, t].item() for t, p in zip(toks, pis)))
        token_sum = 0.0
        for t, p in zip(toks, pis):
            w = seq_w if mode.startswith("sequence") else math.exp(p - behav[i, t].item())
            inside = low <= w <= clip_max
            clipped += not inside
            w = min(max(w, low), clip_max) if mode.endswith("truncate") else w if inside else 0.0
            r = torch.exp(logps[i, t] - p)
            token_sum = token_sum - w * min(r * A, max(min(r, 1 + eps), 1 - eps) * A)
        if not toks:
            continue
        if loss_type == "grpo":
            loss = loss + token_sum / len(toks) / B
        elif loss_type == "dr_grpo":
            loss = loss + token_sum / (B * T)
        else:  # dapo
            loss = loss + token_sum / tokens
    return loss, clipped / tokens


STALE_MODES = [(mode, lo, hi) for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
               for lo, hi in ((None, 1.2), (0.8, 1.1))]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("mode,lo,hi", STALE_MODES)
@pytest.mark.parametrize("tis", [False, True], ids=["decoupled", "tis"])
def test_stale_objectives_match_brute_force(tis, mode, lo, hi, loss_type):
    logps, prox, _, adv, mask = make_batch(seed=40)
    # near the weight's numerator (pi_prox, or TIS's pi); the sequence's weight is a product over its tokens: a
    # smaller gap per token, so that some weights are inside the bounds and some not
    near = torch.where(mask, logps, -1000.0) if tis else prox
    behav = sampler_of(near, seed=41, spread=0.05 if mode.startswith("sequence") else 0.3)
    kw = dict(sampler_logps=behav, sampler_correction=mode, sampler_correction_clip_min=lo,
              sampler_correction_clip_max=hi, loss_type=loss_type)
    fn = truncated_is_loss if tis else decoupled_loss
    loss, grad, stats = loss_and_grad(fn, logps, prox, None, adv, mask, **kw)
    ref_loss, ref_grad, _ = loss_and_grad(reference_stale_loss, logps, None if tis else prox, behav, adv, mask,
                                          loss_type=loss_type, mode=mode, clip_min=lo, clip_max=hi)
    clipped = reference_stale_loss(logps, None if tis else prox, behav, adv, mask, mode=mode, clip_min=lo,
                                   clip_max=hi)[1]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert (grad[~mask] == 0).all() and torch.isfinite(grad).all()
    assert 0 < clipped < 1 and stats["stale/clipped"].item() == pytest.approx(clipped, rel=1e-12)


def test_a_fresh_group_is_grpo_loss_itself():
    """Sampled by the policy before this update (pi_behav = pi_prox), the weight is 1 and nothing is clipped: the
    decoupled objective is the plain clipped one, bitwise."""
    logps, old, ref, adv, mask = make_batch(seed=42)
    plain = loss_and_grad(grpo_loss, logps, old, ref, adv, mask, beta=0.1)
    fresh = loss_and_grad(decoupled_loss, logps, old, ref, adv, mask, beta=0.1, sampler_logps=old)
    assert torch.equal(plain[0], fresh[0]) and torch.equal(plain[1], fresh[1])
    assert fresh[2]["stale/clipped"].item() == 0 and fresh[2]["sampler_correction/weight"].item() == 1


def test_tis_is_decoupled_on_a_rollouts_first_step_and_not_after():
    """On a rollout's first step the proximal policy is the policy itself: the two objectives agree. After a step
    (pi_prox != pi) the decoupled one clips pi / pi_prox where TIS has no clip: they differ."""
    logps, old, ref, adv, mask = make_batch(seed=43)
    behav = sampler_of(old, seed=44)
    kw = dict(sampler_logps=behav, sampler_correction_clip_max=1.2, beta=0.1)
    tis = loss_and_grad(truncated_is_loss, logps, old, ref, adv, mask, **kw)
    first = loss_and_grad(decoupled_loss, logps, logps.clone(), ref, adv, mask, **kw)
    later = loss_and_grad(decoupled_loss, logps, old, ref, adv, mask, **kw)
    torch.testing.assert_close(tis[:2], first[:2], rtol=1e-12, atol=1e-14)
    assert not torch.allclose(tis[1], later[1]) and later[2]["clip_ratio/region"] > 0


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


def test_rloo_is_the_leave_one_out_baseline():
    """A_i = R_i - mean of the group's other rewards: zero sum in each group, G/(G-1) times the group-mean
    baseline's advantage (n/(n-1) with n valid rewards), under every scaling."""
    g = torch.Generator().manual_seed(29)
    rewards = torch.randn(24, generator=g, dtype=DT)
    rewards[torch.rand(24, generator=g) < 0.2] = NAN
    rewards[8:12] = torch.tensor([NAN, NAN, NAN, 2.0], dtype=DT)  # one valid reward: no baseline, advantage 0
    want = []
    for group in rewards.view(-1, 4).tolist():
        valid = [x for x in group if not math.isnan(x)]
        want += [0.0 if math.isnan(x) or len(valid) < 2 else x - (sum(valid) - x) / (len(valid) - 1) for x in group]
    rloo = group_advantages(rewards, 4, "none", "rloo")
    torch.testing.assert_close(rloo, torch.tensor(want, dtype=DT), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rloo.view(-1, 4).sum(-1), torch.zeros(6, dtype=DT), rtol=0, atol=1e-12)
    n = (~rewards.isnan()).view(-1, 4).sum(-1, keepdim=True).to(DT)
    for scale in ("group", "batch", "none"):
        grpo = group_advantages(rewards, 4, scale).view(-1, 4)
        torch.testing.assert_close(group_advantages(rewards, 4, scale, "rloo").view(-1, 4),
                                   torch.where(n > 1, grpo * n / (n - 1).clamp(min=1), 0.0), rtol=1e-12, atol=1e-14)


def test_reinforce_pp_and_gdpo_match_the_statistics_module():
    g = torch.Generator().manual_seed(30)
    scores = torch.randn(16, 2, generator=g, dtype=DT) * torch.tensor([1.0, 10.0], dtype=DT)
    scores[torch.rand(16, 2, generator=g) < 0.2] = NAN
    scores[5] = NAN  # scored by no function
    rewards = scores[:, 0]

    def whiten(xs):  # over the valid entries; NaN -> 0
        valid = [x for x in xs if not math.isnan(x)]
        mean, std = statistics.mean(valid), statistics.stdev(valid)
        return [0.0 if math.isnan(x) else (x - mean) / (std + 1e-4) for x in xs]
    centred = reference_advantages(rewards, 4, "none").tolist()
    centred = [NAN if math.isnan(r) else c for r, c in zip(rewards.tolist(), centred)]
    torch.testing.assert_close(group_advantages(rewards, 4, "none", "reinforce_pp"),
                               torch.tensor(whiten(centred), dtype=DT), rtol=1e-12, atol=1e-14)
    weights = (1.0, 0.5)
    per_fn = [reference_advantages(scores[:, f], 4, "group").tolist() for f in range(2)]
    total = [NAN if math.isnan(s[0]) and math.isnan(s[1]) else weights[0] * a + weights[1] * b
             for s, a, b in zip(scores.tolist(), *per_fn)]
    torch.testing.assert_close(decoupled_advantages(scores, weights, 4), torch.tensor(whiten(total), dtype=DT),
                               rtol=1e-12, atol=1e-14)
    # summing first, the wide second reward decides every group alone; normalising first, both count
    summed = group_advantages(scores.nan_to_num() @ torch.tensor(weights, dtype=DT), 4, "group")
    assert not torch.allclose(summed, decoupled_advantages(scores, weights, 4))


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
    (dict(surrogate="ppo"), "clip, cispo, sapo, vespo"),
    (dict(sampler_correction="tis"), "none, token_truncate, token_mask, sequence_truncate, sequence_mask"),
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
    with pytest.raises(ValueError, match=r"\(B,\) or \(B, T\)"):
        grpo_loss(logps, old, None, torch.zeros(mask.shape[0], mask.shape[1] + 1, dtype=DT), mask)
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(torch.zeros(4), 2, "std")
    with pytest.raises(ValueError, match="grpo, rloo, reinforce_pp"):
        group_advantages(torch.zeros(4), 2, "none", "ppo")
    with pytest.raises(ValueError, match="set scale_rewards='none'"):  # the config's check
        check_loss(dict(scale_rewards="group", advantage_estimator="reinforce_pp"))


def test_is_flat_for_any_group_size():
    """A flat group (all rewards equal, NaN counted as 0) has zero advantage; with G = 1 every group is flat."""
    from rollout import is_flat
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, float('nan'), 0.0], dtype=torch.float64)
    assert is_flat(r, 2).tolist() == [True, False, True]
    assert is_flat(r, 3).tolist() == [False, False]
    assert is_flat(r, 1).tolist() == [True] * 6
    assert is_flat(torch.zeros(4), 4).tolist() == [True]
