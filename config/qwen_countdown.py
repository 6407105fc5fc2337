# Qwen2.5-3B-Instruct on Countdown (TinyZero's task: reach the target with the given numbers, + - * /, each number
# once), Dr. GRPO with DAPO's clip-higher, on one 80 GB GPU: bf16 autocast, torch.compile, activation checkpointing;
# by arithmetic about 58 GB at the update's peak, 75 GB with cuda_graphs=True (README.md, "Real models", which also
# says how to download the model; the task is generated here). A 24 GB GPU: add
# --init_from=models/Qwen2.5-0.5B-Instruct --micro_batch_size=4
# $ python train.py config/qwen_countdown.py

out_dir = 'out-qwen_countdown'
init_from = 'models/Qwen2.5-3B-Instruct'
task = 'countdown'
task_options = {'count': (3, 4)}  # 3 or 4 numbers in 1..99, targets in 1..100
block_size = 1280
max_completion_length = 1024
loss_type = 'dr_grpo'
scale_rewards = 'none'
beta = 0.0
epsilon_high = 0.28  # clip-higher: low-probability tokens may grow
# 32 prompts x 8 completions = 256 per rollout, 2 optimizer steps of 128 (each 32 micro-batches of 4), so the
# second step is off-policy and the clip is live
prompts_per_step = 32
num_generations = 8
steps_per_generation = 2
micro_batch_size = 4
max_iters = 300
learning_rate = 1e-6
eval_interval = 25
eval_size = 256
save_interval = 25
dtype = 'bfloat16'
compile = True
gradient_checkpointing = True
