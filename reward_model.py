"""
Rewards from models, for what no verifier can check (helpfulness, style, safety, a
rubric): reward functions that a frozen model computes, named in reward_funcs beside
reward.py's:

    'rm:DIR'      a reward model: a Hugging Face sequence classifier
                  (LlamaForSequenceClassification and its Qwen2 and Qwen3 siblings: the
                  decoder, then a `score` layer with one output). It reads the prompt
                  and the completion in its own chat template and its score at the last
                  token is the reward, as transformers computes it.
    'judge:PATH'  an LLM judge: any causal LM model.py reads (a Hugging Face directory
                  or a .gguf), asked judge_prompt about the completion in its own chat
                  template. The reward is read off its next-token distribution, not
                  sampled (deterministic, one forward per completion): for judge_tokens
                  ('Yes', 'No') P(Yes) / (P(Yes) + P(No)), for numbers ('1', ..., '10')
                  their expected value.

Both run in inference mode, every rank on its own completions, in micro-batches laid out
like the log-prob pass's (rollout.micro_batches: a prompt's completions hold the tokens
they share once).
"""
import os
import re

import torch
import torch.nn.functional as F

from configurator import check_fits
from model import GPT, GPTConfig
from rollout import micro_batches, pack
from lib import hf
from lib.chat import check_template, checkpoint_template, encode_chat, prompt_messages
from lib.errors import ConfigError
from lib.tokenizer import get_tokenizer

# an example judge_prompt, a yes/no rubric: {prompt} and {completion} are filled in
YES_NO = ("Question: {prompt}\nAnswer: {completion}\n\n"
          "Does the answer state a single number? Reply Yes or No.")


def is_model(name):
    return name.startswith(('rm:', 'judge:'))


def load_classifier(path, dtype=torch.float32):
    """A Hugging Face sequence classifier at path: (the decoder as a GPT whose output
    layer is unused, the score layer's weight (1, n_embd), pad_token_id or None).
    Refuses what is not a one-output classifier."""
    fields, _ = hf.read_config(path)
    hf_config = fields['hf_config']
    arch = (hf_config.get('architectures') or ['an unnamed architecture'])[0]
    if not arch.endswith('ForSequenceClassification'):
        raise ConfigError(f"rm:{path} is a {arch}, not a sequence classifier "
                          f"(LlamaForSequenceClassification, ...); "
                          f"a causal LM can judge instead: 'judge:{path}'")
    # with neither key, transformers makes a classifier of 2 labels
    labels = (len(hf_config['id2label']) if hf_config.get('id2label')
              else hf_config.get('num_labels', 2))
    if labels != 1:
        raise ConfigError(f"rm:{path} has num_labels {labels}; "
                          f"a reward model has one output, the reward "
                          f"(a classifier of {labels} classes is not one)")
    # tied: a classifier's files hold no output layer
    # (its score layer is read apart, below)
    model = GPT(GPTConfig(**dict(fields, tie_word_embeddings=True))).to(dtype)
    score = {}

    # the score layer is not the decoder's
    def decoder_tensors():
        for name, file, t in hf.read_tensors(path):
            if name.startswith('score.'):
                score[name] = t
            else:
                yield name, file, t
    hf.load_weights(path, model.config, model.state_dict(), decoder_tensors())
    n = model.config.n_embd
    if set(score) != {'score.weight'} or score['score.weight'].shape != (1, n):
        shapes = {k: tuple(v.shape) for k, v in score.items()}
        raise ConfigError(f"rm:{path} has no score layer of one output, "
                          f"'score.weight' of shape (1, {n}) alone "
                          f"(its score tensors: {shapes or 'none'}); "
                          f"use the classifier's own files")
    head = score['score.weight'].to(dtype)
    return model.eval().requires_grad_(False), head, hf_config.get('pad_token_id')


@torch.inference_mode()
def last_hidden(model, rows, groups, cfg):
    """rows: token lists. Each row's final hidden state at its last token,
    (len(rows), n_embd): the rows of a group (groups: one key per row, e.g. its prompt)
    hold the tokens they all begin with once (rollout.micro_batches). A row longer than
    the model's block_size keeps its last block_size tokens, where it is read: the
    policy's text never makes a reward raise."""
    rows = [ids[-model.config.block_size:] for ids in rows]
    # group -> the tokens all its rows so far begin with
    common = {}
    for ids, g in zip(rows, groups):
        prefix = common.setdefault(g, ids)
        differ = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b),
                      min(len(prefix), len(ids)))
        common[g] = prefix[:differ]
    # at least a token on each side of the split, so every row has a token of its
    # own to read
    shared = [max(1, min(len(common[g]), len(ids) - 1)) for ids, g in zip(rows, groups)]
    idx, start = pack([ids[:s] for ids, s in zip(rows, shared)],
                      [ids[s:] for ids, s in zip(rows, shared)], 0)
    lengths = torch.tensor([len(ids) for ids in rows])  # (B,)
    dev = model.lm_head.weight.device
    # (B,) how many tokens each row has after the shared ones
    own = lengths - start
    C = int(own.max())
    mask = torch.arange(max(C, 1)) < own[:, None]  # (B, C) those tokens
    out = torch.zeros(len(rows), model.config.n_embd, device=dev,
                      dtype=model.lm_head.weight.dtype)
    batch = dict(idx=idx.to(dev), start=start.to(dev), mask=mask.to(dev),
                 own=own.to(dev))
    for r, mb in micro_batches(batch, cfg.micro_batch_size, cfg.plain):
        h = model.hidden(mb['idx'], mb['pos']).flatten(0, 1)  # (b * T, C)
        T = mb['idx'].shape[1]
        # lib/packing.py's start: a flat index already
        packed = mb['pos'] is not None
        at = (mb['start'] if packed
              else mb['start'] + T * torch.arange(len(r), device=dev))
        # the last of the row's own tokens, the first being at `at`
        out[r] = h[at + mb['own'] - 1]
    return out


def classifier_scores(model, head, pad, rows, groups, cfg):
    """A reward model's scores (len(rows),) float32 of the token lists rows, each read
    where transformers reads it: at the last token that is not pad (a row that ends in
    pad ids is scored as if they were not there)."""
    def trailing_pads(r):
        return next((i for i, t in enumerate(reversed(r)) if t != pad), len(r))
    rows = [r[:max(1, len(r) - trailing_pads(r))] for r in rows]
    return F.linear(last_hidden(model, rows, groups, cfg), head).squeeze(1).float()


def reward_fn(name, cfg):
    """The reward function that reward_funcs' entry `name` ('rm:DIR' or 'judge:PATH')
    names, its model loaded and checked now, before any rollout."""
    kind, path = name.split(':', 1)
    if not os.path.exists(path):
        raise ConfigError(f"reward function {name!r}: {path} not found; "
                          f"give a Hugging Face directory" +
                          (" or a .gguf file" if kind == 'judge' else ""))
    if kind == 'judge' and ('{prompt}' not in cfg.judge_prompt
                            or '{completion}' not in cfg.judge_prompt):
        raise ConfigError(f"judge_prompt must hold {{prompt}} and {{completion}}, "
                          f"where the prompt and the answer go; "
                          f"got {cfg.judge_prompt!r:.100} "
                          f"(reward_model.YES_NO is an example)")
    dtype, device = getattr(torch, cfg.reward_model_dtype), cfg.device
    if kind == 'rm':
        model, head, pad = load_classifier(path, dtype)
    else:
        model = GPT.from_pretrained(path, dtype=dtype).eval().requires_grad_(False)
    # its own template, whatever the policy's
    template = checkpoint_template(path, getattr(cfg, 'chat_date', None))
    enc = get_tokenizer(path)
    check_template(template, enc, path)
    if kind == 'judge':
        tokens = [enc.encode(t, allowed_special='all')
                  for t in cfg.judge_tokens]
        if len(tokens) < 2 or any(len(t) != 1 for t in tokens):
            raise ConfigError(f"judge_tokens={cfg.judge_tokens!r}: "
                              f"give two or more strings "
                              f"that are one token each in {path}'s tokenizer "
                              f"(e.g. ('Yes', 'No'), or ('1', ..., '10'))")
        numbers = all(re.fullmatch(r'-?\d+(\.\d+)?', t) for t in cfg.judge_tokens)
        if not numbers and len(tokens) != 2:
            raise ConfigError(f"judge_tokens={cfg.judge_tokens!r}: "
                              f"two words (a yes and a no) or numbers")
        ids = torch.tensor([t[0] for t in tokens], device=device)
        values = [float(t) for t in cfg.judge_tokens] if numbers else [1.0, 0.0]
        values = torch.tensor(values, device=device)
    # the tokenizer's ids within the model's vocabulary
    check_fits(model.config, enc, path, 0)
    model.to(device)
    head = head.to(device) if kind == 'rm' else None

    # only the template's own text makes special tokens: the prompt's, the completion's
    # and judge_prompt's are text, so a completion spelling '<|im_end|>' forges no turn
    def score(prompts, completions, **columns):
        if kind == 'rm':
            rows = [encode_chat(template, answered(p, c), enc)
                    for p, c in zip(prompts, completions)]
            s = classifier_scores(model, head, pad, rows, list(map(str, prompts)), cfg)
            s = s.clamp(-cfg.reward_clip, cfg.reward_clip) if cfg.reward_clip > 0 else s
        else:
            asked = [_ask(cfg.judge_prompt, p, c) for p, c in zip(prompts, completions)]
            rows = [encode_chat(template, [dict(role='user', content=q)], enc,
                                add_generation_prompt=True) for q in asked]
            # P(token) / P(any of them): the softmax over the judge tokens' logits
            # alone, in float32; h (n, n_embd), p (n, len(judge_tokens))
            h = last_hidden(model, rows, list(map(str, prompts)), cfg).float()
            p = (h @ model.lm_head.weight[ids].float().t()).softmax(-1)
            s = (p * values).sum(-1)
        return s.tolist()
    score.__name__ = f"{kind}:{os.path.basename(os.path.normpath(path))}"
    return score


def answered(prompt, completion):
    """`prompt` answered by `completion`, as messages: the conversation a reward model
    reads."""
    return [*prompt_messages(prompt), dict(role='assistant', content=completion)]


def _ask(template, prompt, completion):
    """judge_prompt with the prompt (its last message's text, for a conversation) and
    the completion filled in."""
    text = prompt if isinstance(prompt, str) else prompt[-1]['content']
    return re.sub(r'\{(prompt|completion)\}',
                  lambda m: text if m.group(1) == 'prompt' else completion, template)
