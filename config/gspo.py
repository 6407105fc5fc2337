# GSPO (Zheng et al. 2025, Qwen): the importance ratio is per sequence, the geometric mean of the token ratios,
# clipped with a tiny range (3e-4 / 4e-4) since it no longer grows with length; several optimizer steps per rollout
# make the clip matter.
# $ torchrun --standalone --nproc_per_node=2 train.py config/gspo.py
out_dir = 'out-gspo'
importance_sampling_level = 'sequence'
epsilon_low, epsilon_high = 3e-4, 4e-4
loss_type = 'grpo'  # GSPO's sequence mean
scale_rewards = 'group'
beta = 0.0
# 32 prompts x 8 = 256 completions per rollout, cut into 4 optimizer steps of 64 (2 ranks x 1 micro-batch of 32)
prompts_per_step = 32
num_generations = 8
steps_per_generation = 4
micro_batch_size = 32
max_iters = 1200
learning_rate = 1e-4
