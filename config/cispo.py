# CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, not the update: -sg(min(r, eps_high)) * A * logp,
# so every token keeps a gradient (PPO's clip zeroes it). epsilon_high is the cap on the weight itself here.
# $ torchrun --standalone --nproc_per_node=2 train.py config/cispo.py
out_dir = 'out-cispo'
surrogate = 'cispo'
epsilon_high = 5.0
loss_type = 'dapo'  # MiniMax-M1 normalises by the step's token count, like DAPO
scale_rewards = 'group'
beta = 0.0
# 32 prompts x 8 = 256 completions per rollout, 2 optimizer steps of 128 (2 ranks x 1 micro-batch of 64)
prompts_per_step = 32
num_generations = 8
steps_per_generation = 2
micro_batch_size = 64
max_iters = 1200
learning_rate = 1e-4
