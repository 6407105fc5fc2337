# GRPO as in DeepSeekMath (Shao et al. 2024): group-std advantages, per-sequence token mean (length-biased),
# and a k3 KL penalty to the reference model in the loss, beta 0.04.
# $ torchrun --standalone --nproc_per_node=2 train.py config/grpo.py
out_dir = 'out-grpo'
loss_type = 'grpo'  # mean over sequences of each sequence's token mean
scale_rewards = 'group'  # A_i = (r_i - mean) / (std + 1e-4) within the group
beta = 0.04
kl_estimator = 'k3'
# 32 prompts x 8 = 256 completions per rollout; 2 ranks x 2 micro-batches of 64 per optimizer step
prompts_per_step = 32
num_generations = 8
micro_batch_size = 64
max_iters = 1200
learning_rate = 1e-4
