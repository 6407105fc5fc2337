"""
The GRPO family of objectives as pure functions on tensors. group_advantages turns a
group's rewards into advantages; grpo_loss composes four stages, each a function of its
own below it: the importance ratio, the policy term (PPO's clip, CISPO, SAPO or VESPO,
then the weights and masks on it), the KL regulariser and the aggregation over tokens.
No model, no I/O; the trainer calls group_advantages (or decoupled_advantages) once per
batch of rollouts and grpo_loss once per micro-batch. The checks of the settings are
configurator.py's (check_loss): a bad config is refused once, before any work, so the
functions here only refuse a name they do not know.

Notation: completion i of a group of G, token t. logp = log pi_theta(token), old_logp
from the policy that sampled (pi_old), ref_logp from the frozen reference, mask = 1 on
tokens that count, A_i the advantage of completion i (or A_t, one a token),
r = exp(logp - old_logp).
Everything here is a loss (the negated objective). Where each paper's equation lives:

  DeepSeekMath GRPO (Shao et al. 2024)
    A_i = (R_i - mean(R)) / std(R)              group_advantages(scale_rewards="group")
    over the group
    min(r A, clip(r, 1-eps, 1+eps) A)           clipped_surrogate (surrogate="clip")
    - beta KL,                                  kl_divergence(estimator="k3") in
    KL = pi_ref/pi - log(pi_ref/pi) - 1         kl_penalty, added per token
    1/G sum_i 1/|o_i| sum_t                     aggregate(loss_type="grpo")
  DAPO (Yu et al. 2025)
    clip-higher: eps_low=0.2, eps_high=0.28     clipped_surrogate's epsilon_low,
                                                epsilon_high
    token-level 1/sum_i|o_i| sum_i sum_t        aggregate(loss_type="dapo")
  Dr. GRPO (Liu et al. 2025)
    A_i = R_i - mean(R), no std                 group_advantages(scale_rewards="none")
    divide by a constant, not by |o_i|          aggregate(loss_type="dr_grpo")
  BNPO (TRL's "bnpo")
    each micro-batch's own token mean,          aggregate(loss_type="bnpo")
    1/sum|o_i| sum_i sum_t over its rows: the
    one normaliser that depends on how the
    step is split
  GSPO (Zheng et al. 2025)
    s_i = (pi(o_i) / pi_old(o_i))^(1/|o_i|),    importance_ratio(level="sequence")
    clipped like r; as GSPO-token,
    sg(s_i) r_t / sg(r_t): s_i in value, each
    token's gradient
  LUSPO (Length-Unbiased Sequence Policy Optimization, 2026)
    each sequence's token mean times its        aggregate(loss_type="luspo")
    length, 1/G sum_i sum_t: a long completion
    is not weighed down by its length
  CISPO (MiniMax-M1, 2025)
    -sg(min(r, eps_high)) A logp: clip the IS   cispo_surrogate (surrogate="cispo")
    weight, not the update, so clipped tokens
    still get a gradient
  Dual clip (Ye et al. 2020; verl's clip_ratio_c)
    with A < 0, cap r at delta so one stale     clipped_surrogate's delta
    token with a huge ratio cannot dominate
    the step
  SAPO (Gao et al. 2025)
    -(4/tau) sigmoid(tau (r - 1)) A: a soft     sapo_surrogate (surrogate="sapo"),
    gate, not a hard clip; its gradient is      tau = sapo_temperature_pos where
    PPO's at r = 1, fading past it              A > 0, else sapo_temperature_neg
  VESPO (2026)
    -phi(w) A logp,                             vespo_surrogate (surrogate="vespo"),
    phi(w) = exp(lambda + k log w - lambda w):  (k, lambda) = vespo_k_pos,
    a detached weight of the sequence ratio     vespo_lambda_pos where A >= 0, else
    w = prod_t r_t                              the _neg pair
  DeepSeek-V3.2 (2025)
    r x KL: weighted by the ratio, the KL's     kl_penalty(bias_correction=True)
    gradient stays unbiased off-policy          (use_bias_correction_kl)
    drop a sequence with A < 0 whose mean       off_policy_mask
    log(pi_sampler / pi) over its tokens        (off_policy_mask_threshold)
    exceeds delta (eq. 9)
  Beyond the 80/20 rule (Wang et al. 2025)
    the policy term only on the top rho share   entropy_threshold, then entropy_mask
    of tokens by entropy, the few 'forking'
    tokens where the answer turns
  Entropy bonus (verl's entropy_coeff)
    - coef x the mean token entropy of the      entropy_coef
    step
  TIS (Yao et al. 2025), MIS / IcePop (Ling team 2025)
    the sampler's log-probs (bf16, another      sampler_weight (sampler_correction=
    engine) are not the trainer's: weight each  "token_truncate" etc.,
    token by rho = pi_old / pi_sampler (or its  sampler_correction_clip_min/max)
    product over the sequence), capped or
    zeroed
  RLOO (Ahmadian et al. 2024), REINFORCE++ (Hu 2025)
    baseline = mean of the other G-1 rewards;   group_advantages(estimator="rloo"),
    or the group mean, then whitened over the   (estimator="reinforce_pp")
    batch
  GDPO (2026)
    each reward function normalised in its      decoupled_advantages
    group, then the weighted sum normalised
    over the batch
  Decoupled PPO (AReaL, Fu et al. 2025)
    a group sampled versions ago: the clip on   decoupled_loss (lib/stream.py's
    r = pi / pi_prox, the policy before the     stale_correction="decoupled")
    update, times min(pi_prox / pi_behav, C)
  Truncated IS (Espeholt et al. 2018; TIS)
    sg(min(pi / pi_behav, C)) A grad log pi:    truncated_is_loss
    no proximal policy, no recompute            (stale_correction="tis")
  On-policy distillation (GKD, Agarwal et al.
  2024; Thinking Machines' tinker-cookbook,
  2025)
    A_t = -(log pi(y_t) - log pi_teacher(y_t))  reverse_kl_advantages, added to the
    on the student's own samples, per token:    reward's advantage times
    its expected policy gradient is the         teacher_weight; discount > 0 sums
    reverse KL's, -grad KL(pi || pi_teacher)    the later tokens' too (tinker's
    at the states the student visits            kl_discount_factor)

Where the KL goes. The GRPO paper adds beta * KL to the loss, per token, instead of
subtracting it from the reward as PPO for RLHF does. That keeps the advantage a pure
group-relative reward signal (a penalty folded into the reward would be centred and
divided by the group's std along with it, and spread evenly over every token of the
sequence), and the regulariser gets its own exact per-token gradient. The PPO placement
is still one line in the trainer (kl_in_reward=True):

    rewards = rewards - beta * (kl_divergence(...) * mask).sum(-1),

computed without gradient before group_advantages, after which grpo_loss runs with
beta=0.

Micro-batching contract. An optimizer step may span many micro-batches on many ranks.
grpo_loss returns this micro-batch's share of the whole step's objective: summing the
gradients of every micro-batch on every rank gives exactly the gradient of the step
objective, provided num_sequences and num_tokens count the whole step (they default to
this micro-batch's, i.e. one micro-batch per step). DDP averages gradients over ranks,
so the trainer multiplies the loss by world_size before backward. The stats it returns
are shares in the same way (a token sum over num_tokens), so their sums over the step
are the step's token means, the same whatever its layout; the maxima among them
(MAX_STATS) are the largest of the micro-batches'.
"""

import functools
import math

import torch

from lib.errors import unknown

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate",
                       "sequence_mask")
SCALES = ("group", "batch", "none")
SURROGATES = ("clip", "cispo", "sapo", "vespo")
KL_ESTIMATORS = ("k1", "k2", "k3")
SAMPLING_LEVELS = ("token", "sequence")


def _mean_std(x, valid):
    """
    Mean and sample (n-1) std over the valid entries of the last dim; the std is 0 with
    fewer than 2 entries.
    """
    n = valid.sum(-1, keepdim=True)
    mean = torch.where(valid, x, 0.0).sum(-1, keepdim=True) / n.clamp(min=1)
    var = ((torch.where(valid, x - mean, 0.0) ** 2).sum(-1, keepdim=True)
           / (n - 1).clamp(min=1))
    return mean, var.sqrt()


def group_advantages(rewards, num_generations, scale_rewards="group", estimator="grpo"):
    """
    rewards: (B,) float, groups are contiguous blocks of num_generations rows; NaN marks
    a reward that does not apply, which is left out of the statistics and gets advantage
    0. The baseline (estimator) is the group mean ("grpo"), the mean of the group's
    other rewards ("rloo": an unbiased baseline, G/(G-1) times grpo's advantage), or the
    group mean followed by whitening over the whole batch ("reinforce_pp", REINFORCE++'s
    baseline variant; over completions, where verl weighs each by its token count). grpo
    and rloo then divide by the sample std of the "group" (DeepSeekMath), of the whole
    "batch" (steadier when G is small), or "none" (Dr. GRPO: the std division
    over-weights groups that are almost all right or all wrong); reinforce_pp has its
    own batch scale and takes "none". Returns (B,) advantages.
    """
    B, G = rewards.shape[0], num_generations
    if scale_rewards not in SCALES:
        raise unknown("scale_rewards", scale_rewards, SCALES)
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise unknown("advantage_estimator", estimator, ADVANTAGE_ESTIMATORS)
    if G < 1 or B % G:
        raise ValueError(f"{B} rewards do not split into groups of "
                         f"num_generations={G}; B must be a multiple of G")
    valid = ~torch.isnan(rewards.view(-1, G))  # (B/G, G)
    r = torch.where(valid, rewards.view(-1, G), 0.0)  # (B/G, G)
    mean, std = _mean_std(r, valid)  # (B/G, 1) each
    advantages = r - mean  # (B/G, G)
    # rloo: r_i - (sum - r_i) / (n - 1) = n / (n - 1) (r_i - mean), and a lone reward
    # has no baseline at all, so it gets 0
    if estimator == "rloo":
        n = valid.sum(-1, keepdim=True)  # (B/G, 1)
        advantages = torch.where(n > 1, advantages * n / (n - 1).clamp(min=1), 0.0)
    # reinforce_pp: whitened with the batch's mean and std of the centred rewards
    if estimator == "reinforce_pp":
        centred = torch.where(valid, advantages, 0.0).view(1, -1)
        batch_mean, std = _mean_std(centred, valid.view(1, -1))  # (1, 1) each
        advantages = advantages - batch_mean
    elif scale_rewards == "batch":
        std = _mean_std(r.view(1, -1), valid.view(1, -1))[1]  # (1, 1)
    if scale_rewards != "none" or estimator == "reinforce_pp":
        # +1e-4: a group with no spread gets 0, not 0/0
        advantages = advantages / (std + 1e-4)
    return torch.where(valid, advantages, 0.0).view(-1)


def decoupled_advantages(scores, weights, num_generations):
    """
    GDPO (TRL's multi_objective_aggregation="normalize_then_sum"): with several reward
    functions, summing first lets the one with the widest spread drown the others inside
    a group; instead each function's scores (a column of scores (B, F), NaN where it
    does not apply) are normalised within their group, the weighted sum is taken, and
    that is normalised over the whole batch. A completion no function scored gets 0.
    Returns (B,) advantages.
    """
    B = scores.shape[0]
    scored = ~torch.isnan(scores).all(-1)  # (B,)
    total = sum(w * group_advantages(scores[:, f], num_generations, "group")
                for f, w in enumerate(weights))  # (B,)
    total = torch.where(scored, total, float("nan"))
    # the batch as one group: centred and scaled by its std
    return group_advantages(total, B, "group")


def reverse_kl_advantages(logps, teacher_logps, mask, discount=0.0):
    """
    On-policy distillation (GKD, Agarwal et al. 2024; Thinking Machines' tinker-cookbook,
    2025): the student samples, a frozen teacher scores each sampled token, and token t's
    advantage is the negated sample of the reverse KL there,
    A_t = -(log pi(y_t) - log pi_teacher(y_t)), (B, T), 0 where mask is 0. logps are the
    student's own when it sampled (the sampler's, a constant: no gradient flows here).
    Under the student's sampling, E[sum_t A_t grad log pi(y_t)] is
    -grad sum_t KL(pi(.|y_<t) || pi_teacher(.|y_<t)), the KL of each step at the states
    the student visits (discount=0, tinker's default). discount=1 adds every later
    counted token's, sum_{s>=t} A_s: the expectation is then -grad KL(pi || pi_teacher)
    of whole sequences, which also steers toward states where the teacher agrees; in
    between, token s weighs discount^(s-t), s - t in positions.
    """
    valid = mask.bool()
    # an observation's or padding's log-probs are no sample of the student's
    gap = torch.where(valid, teacher_logps - logps, 0.0)  # (B, T)
    if discount == 0:
        return gap
    # the discounted sum over the later tokens, from the last one back
    out, later = torch.zeros_like(gap), torch.zeros_like(gap[:, 0])
    for t in reversed(range(gap.shape[1])):
        later = gap[:, t] + discount * later
        out[:, t] = later
    return torch.where(valid, out, 0.0)


def entropy_threshold(entropy, mask, quantile):
    """
    Beyond the 80/20 rule: the entropy at or above which a token is among the top
    `quantile` share (0 < rho <= 1) of the valid tokens, the (1 - rho) quantile with
    linear interpolation. Pass every token of the optimizer step (all micro-batches, all
    ranks): the choice then does not depend on how the step is split.
    entropy_mask = entropy >= threshold selects the policy term's tokens in grpo_loss;
    no valid token gives +inf.
    """
    values = entropy[mask.bool()]
    if values.numel() == 0:
        return torch.tensor(float("inf"))
    return torch.quantile(values, 1 - quantile)


def kl_divergence(logps, ref_logps, estimator="k3"):
    """
    Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by the policy,
    (B, T) -> (B, T), with Schulman's estimators (http://joschu.net/blog/kl-approx.html).
    Used as a loss on on-policy samples, their expected gradients differ: k1's is zero,
    k2's is that of KL(pi_theta || pi_ref) and k3's that of KL(pi_ref || pi_theta).
    """
    # log(pi_ref / pi_theta), clamped so that exp cannot overflow
    log_ratio = (ref_logps - logps).clamp(-20.0, 20.0)
    if estimator == "k1":
        # unbiased, but noisy and often negative
        return -log_ratio
    if estimator == "k2":
        # biased, low variance
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        # unbiased and >= 0: the GRPO paper's choice
        return torch.exp(log_ratio) - log_ratio - 1
    raise unknown("kl_estimator", estimator, KL_ESTIMATORS)


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *,
              loss_type="grpo", beta=0.0,
              epsilon_low=0.2, epsilon_high=0.2, delta=None, surrogate="clip",
              importance_sampling_level="token", kl_estimator="k3",
              max_completion_length=None, num_sequences=None, num_tokens=None,
              sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
              vespo_k_pos=2.0, vespo_lambda_pos=3.0,
              vespo_k_neg=3.0, vespo_lambda_neg=2.0,
              use_bias_correction_kl=False,
              sampler_logps=None, off_policy_mask_threshold=None,
              sampler_correction="none", sampler_correction_clip_min=None,
              sampler_correction_clip_max=3.0,
              entropy=None, entropy_coef=0.0, entropy_mask=None):
    """
    The loss of one micro-batch in four stages: the ratio, the policy term on it, the KL
    to the reference, then the aggregation over tokens.

    logps, old_logps, ref_logps, mask: (B, T); advantages: (B,), one a sequence, or
    (B, T), one a token (on-policy distillation's). old_logps=None means
    on-policy (a single update per batch of rollouts); ref_logps may be None only when
    beta == 0. mask may be bool or float (nonzero counts). For surrogate="cispo",
    epsilon_high is the absolute cap on the IS weight (e.g. 5.0), not 1 + eps.
    max_completion_length is Dr. GRPO's constant; it defaults to T, which is only right
    when every micro-batch is padded to the generation limit. num_sequences / num_tokens
    count the whole optimizer step (see the module doc). sampler_logps (B, T): the
    log-probs the sampler reported, when the trainer recomputed old_logps (they default
    to old_logps): the off-policy mask and sampler_correction compare against them.
    entropy (B, T): each token's entropy, differentiable, for the bonus and the stats;
    entropy_mask (B, T) bool: the tokens the policy term keeps (see entropy_threshold).
    Off-policy masking, entropy_mask and sampler_correction weigh the policy term only;
    dropped tokens still count in the normalisers. use_bias_correction_kl changes the
    KL's gradient even on-policy, where r = 1 in value: d(r KL) = KL d(logp) + d(KL).

    Returns (loss, stats): a scalar and a dict of detached 0-dim tensors. The stats
    follow the loss's contract: each is this micro-batch's share of a token mean over
    the step (a sum over its tokens / num_tokens), so that their sums over the step's
    micro-batches and ranks are the step's means, whatever its layout; the maxima
    (MAX_STATS) are this micro-batch's own.
    """
    B, T = logps.shape
    if mask.shape != logps.shape or advantages.shape not in ((B,), (B, T)):
        raise ValueError(f"shapes do not match: logps {tuple(logps.shape)}, "
                         f"mask {tuple(mask.shape)}, "
                         f"advantages {tuple(advantages.shape)}; "
                         f"expected (B, T), (B, T), (B,) or (B, T)")
    valid = mask.bool()  # (B, T)
    lengths = valid.sum(-1)  # (B,)
    # (B, 1) or (B, T): every term below broadcasts it over the tokens
    A = advantages[:, None] if advantages.dim() == 1 else advantages

    # 1. The ratio. On-policy, old_logp is logp itself with the gradient cut, so r is
    # exactly 1 in value (the clip never fires) while grad r = grad logp: the plain
    # policy gradient.
    if old_logps is None:
        old_logps = logps.detach()
    reported = sampler_logps is not None
    sampler_logps = old_logps.detach() if sampler_logps is None else sampler_logps
    ratio, token_log_ratio = importance_ratio(logps, old_logps, valid,
                                              importance_sampling_level)

    # 2. The policy term: PPO's clip or one of its successors
    if surrogate == "clip":
        term = clipped_surrogate(ratio, A, epsilon_low, epsilon_high, delta)
    elif surrogate == "cispo":
        term = cispo_surrogate(ratio, A, logps, epsilon_high)
    elif surrogate == "sapo":
        term = sapo_surrogate(ratio, A, sapo_temperature_pos, sapo_temperature_neg)
    elif surrogate == "vespo":
        term = vespo_surrogate(token_log_ratio, A, logps, vespo_k_pos, vespo_lambda_pos,
                               vespo_k_neg, vespo_lambda_neg)
    else:
        raise unknown("surrogate", surrogate, SURROGATES)
    per_token, clipped_low, clipped_high = term
    # then what weighs or drops a token's policy term; the KL below keeps every token.
    # sampler_gap = log(pi_old / pi_s)
    sampler_gap = torch.where(valid, old_logps.detach() - sampler_logps, 0.0)
    # the weights and the mask below, where they are on
    rho = off_policy = None
    if sampler_correction != "none":
        rho = sampler_weight(sampler_gap, sampler_correction,
                             sampler_correction_clip_min, sampler_correction_clip_max)
        per_token = per_token * rho
    if off_policy_mask_threshold is not None:
        off_policy = off_policy_mask(sampler_logps, logps, valid, A,
                                     off_policy_mask_threshold)
        per_token = torch.where(off_policy, 0.0, per_token)
    # Beyond the 80/20 rule: only the high-entropy, forking tokens
    if entropy_mask is not None:
        per_token = torch.where(entropy_mask, per_token, 0.0)

    # 3. The KL to the reference, on every token (none without a reference: beta = 0)
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps from a reference model; "
                         f"pass them or set beta=0")
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        kl = kl_penalty(logps, ref_logps, token_log_ratio, kl_estimator,
                        use_bias_correction_kl)
    per_token = torch.where(valid, per_token + beta * kl, 0.0)  # (B, T)

    # 4. The aggregation. Step-wide counts are clamped so that an all-masked batch
    # gives 0, not NaN.
    num_sequences = torch.as_tensor(B if num_sequences is None else num_sequences).clamp(min=1)
    num_tokens = torch.as_tensor(lengths.sum() if num_tokens is None else num_tokens).clamp(min=1)
    max_completion_length = T if max_completion_length is None else max_completion_length
    loss = aggregate(per_token, lengths, loss_type, num_sequences, num_tokens,
                     max_completion_length)
    # a bonus on the step's mean token entropy, the same for every loss_type
    if entropy_coef != 0:
        loss = loss - entropy_coef * torch.where(valid, entropy, 0.0).sum() / num_tokens

    stats = loss_stats(valid, num_tokens, ratio=ratio, kl=kl,
                       clipped=(clipped_low, clipped_high),
                       sampler=((sampler_gap, sampler_logps, old_logps)
                                if reported else None),
                       entropy=entropy, off_policy=off_policy, rho=rho)
    return loss, stats


# -----------------------------------------------------------------------------
# grpo_loss's stages, in the order it runs them

def importance_ratio(logps, old_logps, valid, level="token"):
    """
    The importance ratio r = pi / pi_old of each token, (B, T), and the token log-ratios
    log r_t (B, T) it comes from, 0 on padding. level="token": each token's own ratio
    (PPO, GRPO). level="sequence": GSPO's (Zheng et al. 2025)
    s_i = (pi(o_i) / pi_old(o_i))^(1/|o_i|), the geometric mean of the sequence's token
    ratios, in its GSPO-token form sg(s_i) r_t / sg(r_t): s_i in value on every token of
    the sequence, each token's own log-prob in the gradient. With one advantage per
    sequence that is GSPO's gradient exactly.
    """
    # masked before exp, so that padding can never make inf * 0 = NaN
    token_log_ratio = torch.where(valid, logps - old_logps, 0.0)  # (B, T)
    log_ratio = token_log_ratio
    if level == "sequence":
        lengths = valid.sum(-1)  # (B,)
        # log s_i
        seq_log_ratio = log_ratio.sum(-1, keepdim=True) / lengths.clamp(min=1)[:, None]
        log_ratio = seq_log_ratio.detach() + log_ratio - log_ratio.detach()
    elif level != "token":
        raise unknown("importance_sampling_level", level, SAMPLING_LEVELS)
    return torch.exp(log_ratio), token_log_ratio


# Each policy term returns the per-token loss (B, T) and where a clip took the gradient
# away, below and above the range (B, T) bool, for the stats.

def clipped_surrogate(ratio, A, epsilon_low, epsilon_high, delta=None):
    """
    PPO's clipped surrogate as GRPO (Shao et al. 2024) uses it,
    -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A), with DAPO's clip-higher
    (Yu et al. 2025: epsilon_high above epsilon_low) and the dual clip (Ye et al. 2020;
    verl's clip_ratio_c): with A < 0 the ratio is capped at delta. A: (B, 1) or (B, T).
    """
    # delta caps the ratio the min can pick; with delta > 1 + epsilon_high it only
    # binds for A < 0, where a stale token with a huge ratio would otherwise get an
    # unbounded loss
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    per_token = -torch.min(unclipped * A, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * A)
    # where the min picks the constant
    clipped_low = (ratio < 1 - epsilon_low) & (A < 0)
    clipped_high = (ratio > 1 + epsilon_high) & (A > 0)
    return per_token, clipped_low, clipped_high


def cispo_surrogate(ratio, A, logps, cap):
    """
    CISPO (MiniMax-M1, 2025): -sg(min(r, cap)) A logp. It clips the importance weight,
    not the update, so a token past the cap still gets a gradient; the weight has no
    lower cap.
    """
    per_token = -ratio.clamp(max=cap).detach() * A * logps
    return per_token, torch.zeros_like(ratio, dtype=torch.bool), ratio > cap


def sapo_surrogate(ratio, A, temperature_pos, temperature_neg):
    """
    SAPO (Gao et al. 2025): -(4 / tau) sigmoid(tau (r - 1)) A, a soft gate instead of a
    hard clip, tau = temperature_pos where A > 0, else temperature_neg. Its gradient,
    4 sig (1 - sig) r A, is PPO's at r = 1 and then decays smoothly instead of falling
    off a cliff: nothing is clipped.
    """
    tau = torch.where(A > 0, A.new_tensor(temperature_pos),
                      A.new_tensor(temperature_neg))  # A's shape
    per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A
    no_clip = torch.zeros_like(ratio, dtype=torch.bool)
    return per_token, no_clip, no_clip


def vespo_surrogate(token_log_ratio, A, logps, k_pos, lambda_pos, k_neg, lambda_neg):
    """
    VESPO (2026): -phi(w) A logp, with w = prod_t r_t the sequence's whole ratio and
    phi(w) = exp(lambda + k log w - lambda w), a bounded weight that is 1 at w = 1 and
    carries no gradient; (k, lambda) is (k_pos, lambda_pos) where A >= 0, else
    (k_neg, lambda_neg).
    """
    log_w = (token_log_ratio.clamp(-20, 20).sum(-1, keepdim=True)
             .clamp(math.log(1e-8), 20).detach())
    k = torch.where(A >= 0, A.new_tensor(k_pos), A.new_tensor(k_neg))  # A's shape
    lam = torch.where(A >= 0, A.new_tensor(lambda_pos),
                      A.new_tensor(lambda_neg))  # A's shape
    # a weight that overflows is a sequence too far off to learn from: 0, not inf or NaN
    phi = (torch.exp(lam + k * log_w - lam * log_w.exp())
           .nan_to_num(0.0, 0.0, 0.0))  # A's shape
    per_token = -phi * A * logps
    no_clip = torch.zeros_like(logps, dtype=torch.bool)
    return per_token, no_clip, no_clip


def sampler_weight(sampler_gap, correction, clip_min, clip_max):
    """
    TIS (Yao et al. 2025), MIS / IcePop (Ling team 2025): the sampler's log-probs
    (bf16, another engine) are not the trainer's, so each token's policy term is weighed
    by rho = pi_old / pi_sampler, the token's own ("token_...") or the product over its
    sequence ("sequence_..."). "..._truncate" caps rho at [clip_min, clip_max];
    "..._mask" zeroes it outside that range.
    sampler_gap: (B, T) log(pi_old / pi_sampler), 0 on padding.
    Returns rho, (B, T) or (B, 1).
    """
    if correction not in SAMPLER_CORRECTIONS:
        raise unknown("sampler_correction", correction, SAMPLER_CORRECTIONS)
    sequence = correction.startswith("sequence")
    log_rho = sampler_gap.sum(-1, keepdim=True) if sequence else sampler_gap
    # no inf: e^20 is far past any cap
    rho = log_rho.clamp(max=20).exp()
    low = 0.0 if clip_min is None else clip_min
    # TIS: a capped weight keeps the variance bounded
    if correction.endswith("truncate"):
        return rho.clamp(low, clip_max)
    # MIS / IcePop: where the two disagree too much the token is dropped,
    # not down-weighted
    return torch.where((rho >= low) & (rho <= clip_max), rho, 0.0)


def off_policy_mask(sampler_logps, logps, valid, A, threshold):
    """
    DeepSeek-V3.2 (2025, eq. 9): a sequence with A < 0 whose mean log(pi_sampler / pi)
    over its tokens exceeds threshold is dropped, since a stale negative sample teaches
    the wrong lesson. Returns (B, 1) bool, True for a dropped sequence; with per-token
    advantages (B, T), True on its tokens with A_t < 0.
    """
    drift = _mean_std(sampler_logps - logps.detach(), valid)[0]  # (B, 1)
    return (A < 0) & (drift > threshold)


def kl_penalty(logps, ref_logps, token_log_ratio, estimator="k3",
               bias_correction=False):
    """
    The KL regulariser GRPO (Shao et al. 2024) adds to each token's loss (times beta),
    (B, T). bias_correction: DeepSeek-V3.2's (2025) r x KL, since tokens drawn from
    pi_old estimate the KL under pi only once weighted by their own ratio, at either
    level.
    """
    kl = kl_divergence(logps, ref_logps, estimator)
    return torch.exp(token_log_ratio) * kl if bias_correction else kl


def aggregate(per_token, lengths, loss_type, num_sequences, num_tokens,
              max_completion_length):
    """
    The loss from the per-token terms (B, T), 0 on padding: what each token is divided
    by. grpo (DeepSeekMath): the mean over sequences of their token means, so a token of
    a short sequence weighs more. bnpo (TRL's): this micro-batch's token mean; the step
    objective is the mean over (equal-sized) micro-batches of their token means, so
    unlike the others it depends on how the step is split. dr_grpo (Dr. GRPO): a
    constant divisor, num_sequences x max_completion_length, so every token weighs the
    same whatever its sequence's length. dapo (DAPO): the step's token count, every
    token of the step the same. luspo (LUSPO): the mean over sequences of
    (sequence loss = its token mean) x its length, i.e. of its token sum.
    """
    token_sum = per_token.sum(-1)  # (B,)
    if loss_type == "grpo":
        loss = (token_sum / lengths.clamp(min=1)).sum() / num_sequences
    elif loss_type == "bnpo":
        loss = (token_sum.sum() / lengths.sum().clamp(min=1) * len(lengths)
                / num_sequences)
    elif loss_type == "dr_grpo":
        loss = token_sum.sum() / (num_sequences * max_completion_length)
    elif loss_type == "dapo":
        loss = token_sum.sum() / num_tokens
    elif loss_type == "luspo":
        loss = token_sum.sum() / num_sequences
    else:
        raise unknown("loss_type", loss_type, LOSS_TYPES)
    return loss


# the stats that are maxima: a step's is the largest of its micro-batches',
# not their sum
MAX_STATS = ("ratio/max", "sampler/rho_max")


def loss_stats(valid, num_tokens, *, ratio, kl, clipped, sampler, entropy,
               off_policy, rho):
    """
    What grpo_loss logs of every micro-batch, detached: its shares of the step's token
    means (x summed over the valid tokens in float64, x may be a bool mask, over
    num_tokens, as its loss is its share of the step's loss) and its largest ratio; then,
    where they are on, the entropy, the share of tokens masked off-policy or weighed
    (rho) for the sampler, and the gap
    between the log-probs the sampler reported and the trainer's own
    (sampler: (gap, sampler_logps, old_logps); bf16 sampling, or the full softmax
    trained on top-k/top-p samples): their mean distance, k3's KL(sampler || trainer) in
    float64 (float32's rounding of exp(x) - x - 1 would swamp a gap of a few ulps) and
    the largest rho = pi_old / pi_sampler.
    """
    share = lambda x: torch.where(valid, x, 0).sum(dtype=torch.float64) / num_tokens
    low, high = clipped
    stats = {
        "kl": share(kl), "clip_ratio/low": share(low), "clip_ratio/high": share(high),
        "clip_ratio/region": share(low | high), "ratio/mean": share(ratio),
        # ratios are > 0, so a 0 marks a micro-batch without a token that counts
        "ratio/max": torch.where(valid, ratio, 0.0).max(),
    }
    if sampler is not None:
        gap, sampler_logps, old_logps = sampler
        kl_gap = kl_divergence(sampler_logps.double(),
                               old_logps.detach().double())  # (B, T)
        stats.update({
            "sampler/logp_diff": share(gap.abs()),
            "sampler/kl": share(kl_gap),
            "sampler/rho_max": torch.where(valid, gap, -math.inf).max().exp(),
        })
    if entropy is not None:
        stats["entropy"] = share(entropy)
    # the share of tokens, not of sequences
    if off_policy is not None:
        stats["off_policy_masked"] = share(off_policy)
    if rho is not None:
        stats["sampler_correction/weight"] = share(rho)
    return {k: v.detach() for k, v in stats.items()}


# -----------------------------------------------------------------------------
# Groups sampled some policy versions ago (lib/stream.py, max_staleness > 0): grpo_loss
# with the behaviour policy's log-probs in the sampler's place

def decoupled_loss(logps, prox_logps, ref_logps, advantages, mask, *, sampler_logps,
                   sampler_correction="token_truncate", sampler_correction_clip_min=None,
                   sampler_correction_clip_max=3.0, num_tokens=None, **kwargs):
    """
    AReaL's decoupled PPO (Fu et al. 2025, arXiv 2505.24298, eq. 5) for groups the
    behaviour policy pi_behav sampled some versions ago (sampler_logps: its log-probs).
    PPO's clip on the ratio to the proximal policy, r = pi / pi_prox, times the weight
    w = pi_prox / pi_behav, truncated to [clip_min, clip_max] ("token_truncate"; the
    "..._mask" corrections zero it outside, as AReaL's cap does). prox_logps: the
    policy before this update, its log-probs recomputed; None on a rollout's first
    step, where they are logps' own. The trust region is around pi_prox, not the stale
    pi_behav, so a stale group moves the policy as far as a fresh one. grpo_loss's
    other keywords pass through; stats["stale/clipped"] is the share of tokens whose
    weight the bounds changed.
    """
    loss, stats = grpo_loss(logps, prox_logps, ref_logps, advantages, mask,
                            sampler_logps=sampler_logps,
                            sampler_correction=sampler_correction,
                            sampler_correction_clip_min=sampler_correction_clip_min,
                            sampler_correction_clip_max=sampler_correction_clip_max,
                            num_tokens=num_tokens, **kwargs)
    valid = mask.bool()
    prox = logps.detach() if prox_logps is None else prox_logps
    # the weight before its bounds, per token or per sequence as the correction's
    level = sampler_correction.split("_")[0]
    gap = torch.where(valid, prox - sampler_logps, 0.0)
    rho = sampler_weight(gap, level + "_truncate", None, math.inf)
    low = 0.0 if sampler_correction_clip_min is None else sampler_correction_clip_min
    clipped = ((rho < low) | (rho > sampler_correction_clip_max)) & valid
    count = valid.sum() if num_tokens is None else num_tokens
    share = clipped.sum(dtype=torch.float64) / torch.as_tensor(count).clamp(min=1)
    stats["stale/clipped"] = share.detach()
    return loss, stats


def truncated_is_loss(logps, old_logps, ref_logps, advantages, mask, **kwargs):
    """
    TIS on the ratio to the sampler (Yao et al. 2025's truncated weight; truncated
    importance sampling as in IMPALA, Espeholt et al. 2018): the policy gradient of
    the policy as it is now, each token weighed by w = pi / pi_behav, detached and
    truncated (or masked) to [clip_min, clip_max]. No proximal policy, so no recompute
    and no clip but w's bounds: old_logps is not read. decoupled_loss with
    pi_prox = pi (detached), so the two are one on a rollout's first step.
    """
    return decoupled_loss(logps, None, ref_logps, advantages, mask, **kwargs)


def stale_objective(loss_fn, correction):
    """train.py's loss_fn (grpo_loss with the run's settings by name) made the objective of
    stale groups: loss.py's decoupled_loss ('decoupled') or truncated_is_loss ('tis'), their
    weight bounded as the run's sampler_correction says, TIS's truncation where it is 'none';
    'none': loss_fn itself, the stale groups taken as fresh ones."""
    if correction == 'none':
        return loss_fn
    settings = dict(loss_fn.keywords)
    if settings['sampler_correction'] == 'none':
        settings['sampler_correction'] = 'token_truncate'
    fn = decoupled_loss if correction == 'decoupled' else truncated_is_loss
    return functools.partial(fn, **settings)
