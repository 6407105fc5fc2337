# CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, not the update: -sg(min(r, eps_high)) * A * logp,
# so every token keeps a gradient (PPO's clip zeroes it). epsilon_high is the cap on the weight itself here.
# $ torchrun --standalone --nproc_per_node=2 train.py config/cispo.py
out_dir = 'out-cispo'
surrogate = 'cispo'
epsilon_high = 5.0
loss_type = 'dapo'  # MiniMax-M1 normalises by the step's token count, like DAPO
scale_rewards = 'group'
beta = 0.0
# DAPO's batch layout (config/dapo.py: 32 prompts x 8, two optimizer steps per rollout): the second step is
# off-policy, where the weight's cap is what differs from PPO's clip
from config.dapo import (learning_rate, max_iters, micro_batch_size, num_generations, prompts_per_step,
                         steps_per_generation)
