"""
Lesson exercise 4: where the KL penalty goes, on one hand-made group, with the project's own functions.

    python docs/solutions/kl_placement.py

prints one group's advantages and the loss gradient of each token under both placements: beta in the loss
(kl_in_reward=False, loss.py's default) and the KL subtracted from the reward (kl_in_reward=True, as rollout.rollout
does it). Write your predictions down before you run it; kl_placement.md derives the answers.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from loss import group_advantages, grpo_loss, kl_divergence  # noqa: E402

BETA = 0.04  # config/grpo.py's
DT = torch.float64


def example_group():
    """One prompt's G = 4 completions of up to 3 tokens: (rewards (4,), logps (4, 3), ref_logps (4, 3), mask (4, 3)).
    The policy has moved away from the reference on every token, most of all on completion 3's first token."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=DT)
    logps = torch.tensor([[-0.1, -0.3, -0.2], [-0.5, -0.4, -9.0], [-0.2, -0.1, -0.3], [-0.3, -0.2, -0.1]], dtype=DT)
    ref_logps = logps + torch.tensor([[0.05, -0.1, 0.0], [0.1, 0.2, 0.0], [-0.3, 0.2, 0.1], [-1.5, 0.1, 0.2]],
                                     dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)  # completion 1: 2 tokens
    return rewards, logps, ref_logps, mask


def sequence_kl(logps, ref_logps, mask, estimator="k3"):
    """(G,) each completion's KL summed over its tokens: what kl_in_reward=True takes, times beta, off its reward."""
    return (kl_divergence(logps, ref_logps, estimator) * mask).sum(-1)


def advantages(rewards, logps, ref_logps, mask, beta, kl_in_reward, scale_rewards):
    """The group's advantages as rollout.rollout computes them under either placement (on-policy: old = logps)."""
    shaped = rewards - beta * sequence_kl(logps, ref_logps, mask) if kl_in_reward else rewards
    return group_advantages(shaped, len(rewards), scale_rewards)


def gradient(rewards, logps, ref_logps, mask, beta, kl_in_reward, scale_rewards, loss_type="dapo"):
    """(G, T) d loss / d logp of one on-policy update, grpo_loss called as train.py calls it: with beta, or with
    beta = 0 and the KL already folded into the advantages."""
    adv = advantages(rewards, logps, ref_logps, mask, beta, kl_in_reward, scale_rewards)
    leaf = logps.clone().requires_grad_(True)
    loss, _ = grpo_loss(leaf, None, ref_logps, adv, mask, loss_type=loss_type, beta=0.0 if kl_in_reward else beta)
    loss.backward()
    return leaf.grad


def main():
    torch.set_printoptions(precision=4, sci_mode=False)
    rewards, logps, ref_logps, mask = example_group()
    print(f"rewards {rewards.tolist()}, per-sequence KL {sequence_kl(logps, ref_logps, mask)}, beta {BETA}")
    for scale in ("none", "group"):
        for name, group in (("this group", rewards), ("a flat group (all rewards 1)", torch.ones_like(rewards))):
            print(f"\nadvantages, scale_rewards='{scale}', {name}:")
            for kl_in_reward in (False, True):
                adv = advantages(group, logps, ref_logps, mask, BETA, kl_in_reward, scale)
                print(f"  kl_in_reward={kl_in_reward!s:5}  {adv}")
    for kl_in_reward in (False, True):
        grad = gradient(rewards, logps, ref_logps, mask, BETA, kl_in_reward, "none")
        print(f"\nd loss / d logp (dapo, scale_rewards='none'), kl_in_reward={kl_in_reward}; 0 where masked:\n{grad}")


if __name__ == "__main__":
    main()
