# Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"): the default run, and
# train.py's defaults (this file only names it). No std scaling of advantages and a constant normaliser instead of
# 1/|o_i|, so neither easy/hard questions nor long/short answers are weighted up; no KL (beta 0), so no reference
# model is kept.
# $ torchrun --standalone --nproc_per_node=2 train.py config/dr_grpo.py   (2 CPU cores, 5 to 10 minutes)
# batch arithmetic (train.py's defaults): 32 prompts x 8 completions = 256 completions per rollout; on 2 ranks each
# holds 128, taken as 2 micro-batches of 64 for one optimizer step (mu = 1: each rollout is used once, so the ratio
# is exactly 1); 1200 iterations after a warm start that ends at 30% greedy accuracy on train prompts
out_dir = 'out-dr_grpo'
loss_type = 'dr_grpo'  # token sum / (sequences x max_completion_length)
scale_rewards = 'none'  # A_i = r_i - mean(group)
beta = 0.0
