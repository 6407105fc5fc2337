# Qwen2.5-0.5B-Instruct on GSM8K with Dr. GRPO, on one GPU: bf16 autocast, torch.compile, activation checkpointing.
# Download the model and the data first (README.md, "Real models"), then:
# $ python train.py config/qwen_gsm8k.py
# Qwen2.5-1.5B-Instruct: add --init_from=models/Qwen2.5-1.5B-Instruct --out_dir=out-qwen1.5b_gsm8k

out_dir = 'out-qwen_gsm8k'
init_from = 'models/Qwen2.5-0.5B-Instruct'  # its tokenizer, chat template, generation_config too
task = 'data/gsm8k/{split}.jsonl'  # the question + "put your final answer within \boxed{}"; reward: the number
block_size = 1024  # template + question stay under ~300 tokens
max_completion_length = 512
loss_type = 'dr_grpo'
scale_rewards = 'none'
beta = 0.0
# 32 prompts x 8 completions = 256 per rollout, one optimizer step over 32 micro-batches of 8 (gradient
# accumulation; on N GPUs each takes 32/N prompts and 32/N micro-batches, for the same update)
prompts_per_step = 32
num_generations = 8
micro_batch_size = 8
max_iters = 200
learning_rate = 1e-6
eval_interval = 25
eval_size = 256  # of GSM8K's 1319 test problems: greedy, then 8 samples each for pass@k
save_interval = 25
dtype = 'bfloat16'
compile = True
gradient_checkpointing = True
