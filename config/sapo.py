# SAPO (Gao et al. 2025, Qwen): a soft gate instead of PPO's hard clip. A token's gradient is PPO's unclipped one
# times 4 sig(tau (r - 1)) (1 - sig(tau (r - 1))): 1 at r = 1, fading smoothly as its ratio drifts instead of
# dropping to 0 past 1 + eps, and faster for negative advantages (tau_neg > tau_pos), whose off-policy updates are
# the less stable. On-policy it is the plain policy gradient, so several optimizer steps per rollout make it matter.
# $ torchrun --standalone --nproc_per_node=2 train.py config/sapo.py
out_dir = 'out-sapo'
surrogate = 'sapo'
sapo_temperature_pos = 1.0
sapo_temperature_neg = 1.05
loss_type = 'grpo'  # TRL aggregates SAPO like GRPO: the mean over sequences of their token means
scale_rewards = 'group'
beta = 0.0
# GSPO's batch layout (config/gspo.py: 32 prompts x 8, four optimizer steps per rollout): steps 2-4 are off-policy
from config.gspo import (learning_rate, max_iters, micro_batch_size, num_generations, prompts_per_step,
                         steps_per_generation)
