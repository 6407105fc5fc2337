# GPU recipe: GRPO from GPT-2 (124M) weights on 3-digit addition, with the GPT-2 tokenizer, bf16 autocast and
# torch.compile. Get the weights in the Hugging Face layout first (config.json + model.safetensors, e.g. with
# huggingface-cli download gpt2 --local-dir gpt2), then on one node of 8 GPUs:
# $ torchrun --standalone --nproc_per_node=8 train.py config/grpo_gpt2.py
out_dir = 'out-grpo_gpt2'
init_from = 'gpt2'  # the directory downloaded above
tokenizer = 'gpt2'
task_options = {'digits': 3}
block_size = 64  # prompts are ~6 tokens, completions at most 8: no need for GPT-2's 1024
max_completion_length = 8
sft_iters = 200  # GPT-2 cannot add: a short supervised warm start gives RL some rewards to compare
sft_batch_size = 256
sft_learning_rate = 1e-4
loss_type = 'dr_grpo'
scale_rewards = 'none'
beta = 0.0
# 256 prompts x 8 completions = 2048 per rollout; 8 GPUs x 256 each, 2 micro-batches of 128, one optimizer step
prompts_per_step = 256
num_generations = 8
micro_batch_size = 128
max_iters = 500
learning_rate = 1e-5
dtype = 'bfloat16'
compile = True
