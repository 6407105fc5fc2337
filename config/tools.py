# Tool use learnt with RL on a laptop CPU: the tiny model of the default run multiplies 3-digit numbers, which it
# cannot do in its head, with a calculator it calls mid-answer (envs.Calculator). It writes '<123*456>', the
# environment appends the exact value on a line, '56088\n' (context, not the policy's: masked in the loss, read into
# the KV cache without re-reading the rest), and the model answers '56088'. The warm start learns from the task's
# demonstrations of that until 10% of train prompts come out right (the copying it needs forms within a few steps,
# so it checks every 5); RL does the rest, sampling at temperature 0.5 (at 1 a six-digit copy is rarely whole).
# $ torchrun --standalone --nproc_per_node=2 train.py config/tools.py
# $ torchrun --standalone --nproc_per_node=2 train.py config/tools.py --env= --out_dir=out-notools  # no calculator
# batch arithmetic: 32 prompts x 8 completions = 256 trajectories per rollout, 128 per rank in 2 micro-batches of
# 64, one optimizer step (mu = 1); a trajectory is at most 24 tokens, the calculator's result included
out_dir = 'out-tools'
task = 'multiplication'  # 'a*b=' for a, b of 3 digits; held out: 10% of the products
env = 'calculator'
max_turns = 2  # a call, then the answer
max_completion_length = 24
block_size = 40
sft_target_acc = 0.1
sft_check_interval = 5
temperature = 0.5
max_iters = 150
eval_interval = 25
