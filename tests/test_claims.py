"""
The argued questions that docs/ answers, each settled by assertions that could fail: where the KL goes, why a sum
over tokens and which one, what PPO's clip does when each rollout is used once, why the loss reads about zero while
the model learns, what a flat group contributes, and that generate prefills a prompt once for all its samples.
tests/test_loss.py proves several of them on synthetic log-probs; here most run on one real step: a tiny random
model samples with model.generate, rollout.pack builds the batch, the model's log-prob pass carries the gradient.
"""
import pytest
import torch

from loss import LOSS_TYPES, grpo_loss, group_advantages, kl_divergence
from model import GPT, GPTConfig
from rollout import pack

DT = torch.float64
G, C = 4, 12  # samples per prompt, completion length limit
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # the third group is flat


def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32)).to(DT)


@pytest.fixture(scope='module')
def step():
    """One real on-policy step: 3 prompts x G samples from model.generate (8 of the 64 ids end a row, so lengths
    differ), fixed 0/1 rewards, group advantages; returns (model, batch) with the batch as the trainer's."""
    model = tiny_model()
    prompts = [[5, 9, 2], [7, 7], [1, 2, 3, 4]]
    tokens, mask, sampler_logps = (t.clone() for t in model.generate(  # clones: generate's are inference tensors
        prompts, C, num_samples=G, eos_id=list(range(56, 64)), generator=torch.Generator().manual_seed(1)))
    assert mask.shape[1] == C and len(set(mask.sum(1).tolist())) > 2, "want a step with completions of many lengths"
    idx, start = pack([p for p in prompts for _ in range(G)], tokens.tolist(), 56)
    advantages = group_advantages(torch.tensor(REWARDS, dtype=DT), G, 'none')
    return model, dict(idx=idx, start=start, mask=mask, sampler_logps=sampler_logps.to(DT), advantages=advantages)


def logps_of(model, batch):
    return model(batch['idx'], batch['start'], C)  # (B, C), the trainer's forward, with gradient


def param_grad(loss, model):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


def policy_gradient_loss(logps, batch):
    """REINFORCE written out: -1/(B C) sum_i A_i log pi(o_i), log pi(o_i) the sum of its tokens' log-probs."""
    B = logps.shape[0]
    return -(batch['advantages'] * (logps * batch['mask']).sum(1)).sum() / (B * C)


# -----------------------------------------------------------------------------
# what PPO's clip does when each rollout is used once: nothing

def test_one_update_per_rollout_the_ratio_is_one_and_the_clip_never_fires(step):
    model, batch = step
    want = param_grad(policy_gradient_loss(logps_of(model, batch), batch), model)
    grads = []
    for eps, delta in ((0.2, None), (1e-3, None), (0.2, 1.5)):
        loss, stats = grpo_loss(logps_of(model, batch), None, None, batch['advantages'], batch['mask'],
                                loss_type='dr_grpo', epsilon_low=eps, epsilon_high=eps, delta=delta)
        assert stats['ratio/mean'].item() == 1.0 and stats['ratio/max'].item() == 1.0
        assert stats['clip_ratio/region'].item() == 0.0
        grads.append(param_grad(loss, model))
        torch.testing.assert_close(grads[-1], want, rtol=1e-12, atol=1e-15)  # the plain policy gradient
    assert all(torch.equal(g, grads[0]) for g in grads)  # however tight the clip: it never binds
    # the log-probs generate reported are the trainer's own, so passing them as old_logps changes nothing either
    _, stats = grpo_loss(logps_of(model, batch), batch['sampler_logps'], None, batch['advantages'], batch['mask'])
    assert abs(stats['ratio/max'].item() - 1) < 1e-5 and stats['clip_ratio/region'].item() == 0.0


# -----------------------------------------------------------------------------
# why the loss reads about zero while the model learns

def test_the_loss_value_does_not_depend_on_the_parameters_but_its_gradient_does(step):
    model, batch = step
    adv, mask = batch['advantages'], batch['mask']
    lengths = mask.sum(1).to(DT)
    moved = tiny_model()
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for loss_type in LOSS_TYPES:
        (loss, _), (loss_moved, _) = (grpo_loss(logps_of(m, batch), None, None, adv, mask, loss_type=loss_type)
                                      for m in (model, moved))
        # on-policy every ratio is 1 whatever the weights: the value is fixed by advantages and lengths alone
        assert loss.item() == pytest.approx(loss_moved.item(), abs=1e-15)
        loss, _ = grpo_loss(logps_of(model, batch), None, None, adv, mask, loss_type=loss_type)
        assert param_grad(loss, model).norm() > 1e-3
    # grpo: -mean_i A_i, zero up to rounding since advantages sum to zero in each group
    loss, _ = grpo_loss(logps_of(model, batch), None, None, adv, mask, loss_type='grpo')
    assert abs(loss.item()) < 1e-15
    # dr_grpo: -sum_i A_i |o_i| / (B C), the covariance of advantage and length, not a measure of progress
    loss, _ = grpo_loss(logps_of(model, batch), None, None, adv, mask, loss_type='dr_grpo')
    assert loss.item() == pytest.approx(-(adv * lengths).sum().item() / (len(adv) * C), rel=1e-12)
    g_moved = param_grad(grpo_loss(logps_of(moved, batch), None, None, adv, mask)[0], moved)
    g = param_grad(grpo_loss(logps_of(model, batch), None, None, adv, mask)[0], model)
    assert not torch.allclose(g, g_moved)


# -----------------------------------------------------------------------------
# why a sum over tokens, and which sum

def test_the_policy_gradient_is_a_token_sum_and_grpo_divides_it_by_each_length(step):
    model, batch = step
    adv, mask = batch['advantages'], batch['mask']
    B, lengths, tokens = len(adv), mask.sum(1).to(DT), mask.sum().item()

    def grads(fn):
        logps = logps_of(model, batch).detach().requires_grad_(True)
        return torch.autograd.grad(fn(logps), logps)[0]  # (B, C): each token's weight
    sequence_pg = grads(lambda lp: policy_gradient_loss(lp, batch) * C)  # -1/B sum_i A_i log pi(o_i)
    of = lambda loss_type: grads(lambda lp: grpo_loss(lp, None, None, adv, mask, loss_type=loss_type)[0])
    torch.testing.assert_close(of('luspo'), sequence_pg, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(of('dr_grpo') * C, sequence_pg, rtol=1e-12, atol=1e-15)  # a constant divisor
    torch.testing.assert_close(of('dapo') * tokens / B, sequence_pg, rtol=1e-12, atol=1e-15)  # constant in a step
    torch.testing.assert_close(of('grpo') * lengths[:, None], sequence_pg, rtol=1e-12, atol=1e-15)  # per row 1/|o_i|
    # so under grpo, of two wrong answers in a group, the long one's every token is pushed down less
    short, long_ = sorted([1, 2], key=lambda i: lengths[i])  # the first group's two wrong answers
    assert lengths[long_] > lengths[short] and adv[long_] == adv[short] < 0
    assert of('grpo')[long_, 0] < of('grpo')[short, 0] and of('dr_grpo')[long_, 0] == of('dr_grpo')[short, 0]


# -----------------------------------------------------------------------------
# where the KL goes: in the loss, or in the reward

def test_kl_in_the_reward_ranks_a_flat_group_by_its_kl_whatever_beta():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=DT)  # all right: nothing to learn from the reward
    kl = torch.tensor([0.10, 0.12, 0.30, 0.05], dtype=DT)  # each completion's summed KL to the reference
    assert (group_advantages(rewards, 4, 'group') == 0).all()  # KL in the loss: the group's advantages stay 0
    standardised = -(kl - kl.mean()) / kl.std()
    for beta in (0.01, 0.1):
        adv = group_advantages(rewards - beta * kl, 4, 'group')
        # divided by the group's std, a beta-sized penalty becomes an advantage of order 1, the KL's ranking
        torch.testing.assert_close(adv, standardised, rtol=0.1, atol=0)
        assert adv.abs().max() > 1.0
        # without the std division it stays beta-sized
        torch.testing.assert_close(group_advantages(rewards - beta * kl, 4, 'none'), -beta * (kl - kl.mean()))


def test_kl_in_the_loss_is_its_own_per_token_gradient_the_same_in_any_group():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 6, generator=g, dtype=DT)
    ref = logps + 0.3 * torch.randn(4, 6, generator=g, dtype=DT)
    mask = torch.ones(4, 6, dtype=torch.bool)
    beta = 0.04
    for rewards in ([1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0]):
        adv = group_advantages(torch.tensor(rewards, dtype=DT), 4, 'group')
        lp = logps.clone().requires_grad_(True)
        with_kl = torch.autograd.grad(grpo_loss(lp, None, ref, adv, mask, beta=beta, loss_type='luspo')[0], lp)[0]
        without = torch.autograd.grad(grpo_loss(lp, None, None, adv, mask, loss_type='luspo')[0], lp)[0]
        kl_grad = torch.autograd.grad((beta * kl_divergence(lp, ref, 'k3')).sum() / 4, lp)[0]
        torch.testing.assert_close(with_kl - without, kl_grad, rtol=1e-12, atol=1e-15)  # added, not mixed in


# -----------------------------------------------------------------------------
# what a flat group contributes

@pytest.mark.parametrize('scale, estimator', [('group', 'grpo'), ('batch', 'grpo'), ('none', 'grpo'),
                                              ('group', 'rloo'), ('none', 'reinforce_pp')])
def test_a_flat_group_contributes_nothing(step, scale, estimator):
    model, batch = step
    adv = group_advantages(torch.tensor(REWARDS, dtype=DT), G, scale, estimator)
    assert adv[2 * G:].abs().max() < 1e-12  # the flat third group
    for loss_type in LOSS_TYPES:
        logps = logps_of(model, batch).detach().requires_grad_(True)
        loss, _ = grpo_loss(logps, None, None, adv, batch['mask'], loss_type=loss_type)
        grad = torch.autograd.grad(loss, logps)[0]
        assert grad[2 * G:].abs().max() < 1e-12 and grad[:2 * G].abs().max() > 1e-4


# -----------------------------------------------------------------------------
# the sampler: a prompt is prefilled once, whatever the number of samples

def test_generate_prefills_each_prompt_once_for_all_its_samples():
    model = tiny_model()
    hidden, calls = model.hidden, []

    def counted(idx, *args, **kwargs):  # generate reaches the transformer only through self.hidden
        calls.append(tuple(idx.shape))
        return hidden(idx, *args, **kwargs)
    model.hidden = counted
    prompts = [[5, 9, 2], [7, 7], [1, 2, 3, 4]]
    tokens, _, _ = model.generate(prompts, 6, num_samples=8, generator=torch.Generator().manual_seed(0))
    prefills = [shape for shape in calls if shape[1] > 1]
    assert prefills == [(1, len(p)) for p in prompts]  # one row per prompt, not 8
    assert all(shape == (24, 1) for shape in calls[len(prompts):])  # then one token for each of the 24 rows a step
    assert len(calls) == len(prompts) + 5 and tokens.shape == (24, 6)
