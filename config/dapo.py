# DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-level normalisation over the whole step, dynamic sampling
# (groups whose completions all score the same are resampled), overlong filtering and the soft overlong punishment.
# $ torchrun --standalone --nproc_per_node=2 train.py config/dapo.py
out_dir = 'out-dapo'
loss_type = 'dapo'  # token sum / valid tokens in the whole optimizer step
scale_rewards = 'group'
beta = 0.0
epsilon_low, epsilon_high = 0.2, 0.28
dynamic_sampling = True
max_resample_rounds = 3
mask_truncated_completions = True
reward_funcs = ('exact_match', 'overlong')  # overlong: 0 up to 4/5 of max_completion_length, then down to -1
reward_weights = (1.0, 1.0)
# 32 prompts x 8 = 256 completions per rollout, used for 2 optimizer steps (128 each: 2 ranks x 1 micro-batch of
# 64), so the second step is off-policy and the clip is live
prompts_per_step = 32
num_generations = 8
steps_per_generation = 2
micro_batch_size = 64
max_iters = 1200
learning_rate = 1e-4
