"""
TRL's GRPOTrainer on bench.py's default shape, for README's side-by-side: the same 30M GPT-2 (6 layers, 6 heads,
384 wide, 50304-token vocabulary, random weights), float32 on the CPU, 8 prompts x 8 completions of exactly 128
tokens after 64-token prompts (a random model never samples the eos), one optimizer step per rollout over
micro-batches of 16, no KL (beta 0), Dr. GRPO's loss. TRL is not a dependency of nanoGRPO: run this in its own
virtualenv, then ours on the same machine right after, and compare the seconds per iteration:

$ python3 -m venv /tmp/trl && /tmp/trl/bin/pip install torch==2.13.0 trl
$ /tmp/trl/bin/python scripts/bench_trl.py
$ python -m scripts.bench --only iteration
"""
import random
import sys
import time

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4  # the first is a warm-up

# bench.py's prompts: 64 random letters, a token each (byte-level, no merges, as train.py's byte tokenizer)
alphabet = pre_tokenizers.ByteLevel.alphabet()
vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {'<|endoftext|>': len(alphabet)}
core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token='<|endoftext|>', pad_token='<|endoftext|>')
rng = random.Random(1)
prompts = [''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(64)) for _ in range(8 * steps)]
assert all(len(tokenizer(p)['input_ids']) == 64 for p in prompts)

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_head=6, n_embd=384, vocab_size=50304, n_positions=1024,
                                   bos_token_id=256, eos_token_id=256))


def reward(completions, **kwargs):  # as cheap as bench.py's task reward
    return [float(len(c) % 2) for c in completions]


class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        seconds.append(time.perf_counter() - self.t)


seconds = []
config = GRPOConfig(output_dir='/tmp/bench_trl', per_device_train_batch_size=16, gradient_accumulation_steps=4,
                    num_generations=8, max_completion_length=128, temperature=1.0, beta=0.0,
                    loss_type='dr_grpo', scale_rewards='none', learning_rate=1e-5, max_steps=steps,
                    logging_steps=1, save_strategy='no', report_to=[], use_cpu=True, seed=0,
                    bf16=False)  # TRL's default is bf16 autocast: ~75x slower matmuls on a CPU without bf16 units
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({'prompt': prompts}), callbacks=[Clock()])
trainer.train()
logs = [m for m in trainer.state.log_history if 'completions/mean_length' in m]
print(f"completion lengths {[m['completions/mean_length'] for m in logs]}")
print(f"TRL GRPOTrainer: {len(seconds)} iterations, {' '.join(f'{s:.2f}' for s in seconds)} s; "
      f"mean after the first {sum(seconds[1:]) / len(seconds[1:]):.2f} s per iteration")
