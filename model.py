"""
The policy: one decoder-only transformer in three flavours, with the three things a GRPO trainer needs from it:
- GPT-2 (model_type 'gpt2'): learned positions, LayerNorm, tanh-GELU MLP, tied embeddings;
- the Llama family ('llama', 'qwen2', 'qwen3', 'mistral'): rotary positions, RMSNorm, SwiGLU MLP, grouped-query
  attention, and per family q/k/v biases (Qwen2) or a per-head RMSNorm of queries and keys (Qwen3);
- Gemma 3 ('gemma3_text'): Qwen3's block with Gemma's changes, each marked "Gemma:" where it is made.
1) logprobs(): per-token log-probs of given completions, chunked so a (B, T, vocab) float32 tensor never exists,
2) generate(): fast sampling of many completions per prompt with a static KV cache (its loop is engine.py's),
3) from_pretrained() / save_pretrained(): Hugging Face checkpoints without transformers (the format is lib/hf.py's), and
   from_pretrained() of a GGUF file (lib/gguf_file.py).
Module names follow Hugging Face's GPT2LMHeadModel; lib/hf.py maps the other families' names (and splits the fused
q/k/v and gate/up matrices) key by key.
"""

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import engine
import sampling
from sampling import check_sampling, sample
from lib import gguf_file, head, hf, packing
from lib.errors import ConfigError
from lib.truncation import truncate_

class RMSNorm(nn.Module):

    def __init__(self, dim, eps, gemma=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps, self.gemma = eps, gemma

    def forward(self, x):
        # the statistics in float32 even under bf16 (float64 stays), cast back before the weight, as Llama does
        y = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), x.shape[-1:], eps=self.eps)
        if self.gemma:  # Gemma: the weight is stored as w and scales by 1 + w, before the cast back
            return (y * (1.0 + self.weight.to(y.dtype))).type_as(x)
        return self.weight * y.type_as(x)

def norm(config, dim=None):
    if config.model_type == "gpt2":
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
    return RMSNorm(dim or config.n_embd, config.norm_eps, gemma=config.model_type == "gemma3_text")

def rope_frequencies(config, device, local=False):
    """The rotary inverse frequencies (head_dim / 2,) float32, with the scaling the config has: 'linear' divides them
    all by factor (Gemma 3's global layers); Llama-3.1's stretches wavelengths longer than the original context /
    low_freq_factor by factor, keeps those shorter than original context / high_freq_factor, and blends the band
    between. local: Gemma 3's sliding-window layers, which have a base of their own and no scaling."""
    hd = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, device=device).float() / hd)
    s = None if local else config.rope_scaling
    if s is None:
        return inv_freq
    if s.get("rope_type") == "linear":
        return inv_freq / s["factor"]
    ctx, lo, hi = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0: long wavelengths, 1: short ones
    return (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq

def rotary(config, pos, dtype, local=False):
    """cos and sin (B or 1, 1, T, head_dim) of each position's rotary angles, computed in float32."""
    angle = pos[..., None].float() * rope_frequencies(config, pos.device, local)  # (.., T, hs/2)
    angle = torch.cat((angle, angle), dim=-1).view(-1, 1, pos.size(-1), config.head_dim)
    return angle.cos().to(dtype), angle.sin().to(dtype)

def rotate(x, cos, sin):
    """Rotary embedding, the rotate-half convention: the two halves of each head, not interleaved pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin

class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        assert config.n_head % config.n_kv_head == 0
        # q, k, v for all heads in one matmul; with grouped-query attention k and v have fewer heads than q
        qkv = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        self.c_attn = nn.Linear(config.n_embd, qkv, bias=config.bias or config.qkv_bias)
        self.c_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=config.bias)
        if config.qk_norm:  # Qwen3, Gemma 3: each head's queries and keys are RMS-normalised, before rotary
            self.q_norm, self.k_norm = norm(config, config.head_dim), norm(config, config.head_dim)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        # Gemma: scores scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5 (None, sdpa's default)
        self.scale = config.query_pre_attn_scalar and config.query_pre_attn_scalar ** -0.5

    def forward(self, x, rope=None, kv=None, col=0, key_mask=None):
        B, T, C = x.size()
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.c_attn(x).split([nh * hs, nkv * hs, nkv * hs], dim=2)
        q, k, v = q.view(B, T, nh, hs), k.view(B, T, nkv, hs), v.view(B, T, nkv, hs)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs), (B, nkv, T, hs) x 2
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        # kv: this layer's static cache, keys and values (rows, nkv, S, hs)
        if kv is not None and not torch.is_tensor(col):  # prefill of one prompt (B=1): into its sample rows
            kv[0][:, :, col:col + T] = k
            kv[1][:, :, col:col + T] = v
        elif kv is not None:  # decoding: each row's T tokens go into its cache from column col[row] (a tensor, so
            # every step runs the same shapes) on; in the cache's dtype: under autocast rotary keeps q and k in float32
            at = col[:, None] + torch.arange(T, device=col.device)  # (B or 1, T) the columns written
            rows = torch.arange(B, device=col.device)[:, None]
            kv[0][rows, :, at] = k.transpose(1, 2).to(kv[0].dtype)  # (B, T, nkv, hs)
            kv[1][rows, :, at] = v.transpose(1, 2).to(kv[1].dtype)
            # key_mask (B, 1, T, S) hides the padding and what is not written yet. The g = nh // nkv query heads that
            # share a kv head are that head's queries (h uses kv head h // g), so the cache is read, never repeated
            g = nh // nkv
            mask = key_mask.repeat(1, 1, g, 1) if T > 1 and g > 1 else key_mask  # (B, 1, g * T, S)
            y = F.scaled_dot_product_attention(q.reshape(B, nkv, g * T, hs).to(kv[0].dtype), *kv, attn_mask=mask,
                                               scale=self.scale)
            y = y.view(B, nkv, g, T, hs).permute(0, 3, 1, 2, 4).reshape(B, T, nh * hs)  # heads side by side
            return self.resid_dropout(self.c_proj(y))
        # key_mask here: packed rows (B, 1, T, T), each token sees the earlier tokens of its own row and prompt; or
        # a sliding window's (T, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=key_mask is None,
                                           enable_gqa=nkv != nh, dropout_p=self.dropout if self.training else 0.0,
                                           scale=self.scale)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.swiglu, self.gemma = config.model_type != "gpt2", config.model_type == "gemma3_text"
        bias = config.bias and not self.swiglu  # the Llama family's MLP has no biases
        self.c_fc = nn.Linear(config.n_embd, (2 if self.swiglu else 1) * config.n_inner, bias=bias)  # SwiGLU: gate, up
        self.c_proj = nn.Linear(config.n_inner, config.n_embd, bias=bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            if self.gemma:  # Gemma: the gate through tanh-GELU (GeGLU), not SiLU
                return self.dropout(self.c_proj(F.gelu(gate, approximate="tanh") * up))
            return self.dropout(self.c_proj(F.silu(gate) * up))
        # GPT-2's GELU is the tanh approximation (HF "gelu_new"); the exact erf GELU would miss its logits by ~1e-4
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))

class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)
        if config.model_type == "gemma3_text":  # Gemma: the attention's and the MLP's outputs normalised too
            self.post_attn_norm, self.post_mlp_norm = norm(config), norm(config)

    def forward(self, x, rope=None, kv=None, col=0, key_mask=None):
        y = self.attn(self.ln_1(x), rope, kv, col, key_mask)
        x = x + (self.post_attn_norm(y) if hasattr(self, "post_attn_norm") else y)
        y = self.mlp(self.ln_2(x))
        return x + (self.post_mlp_norm(y) if hasattr(self, "post_mlp_norm") else y)

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # GPT-2: biases in Linears and LayerNorms (False is a bit better and faster); Llama family:
    # biases in q, k, v and the attention output (config.json's attention_bias)
    model_type: str = "gpt2"  # or 'llama', 'qwen2', 'qwen3', 'mistral', 'gemma3_text': the fields below
    n_kv_head: int = None  # grouped-query attention; None = n_head
    head_dim: int = None  # None = n_embd // n_head
    n_inner: int = None  # the MLP's hidden width; None = 4 * n_embd
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = None  # Llama-3.1's: factor, low/high_freq_factor, original_max_position_embeddings;
    # or dict(rope_type='linear', factor=...)
    qkv_bias: bool = False  # Qwen2: biases in q, k, v only
    qk_norm: bool = False  # Qwen3, Gemma 3
    layer_types: tuple = None  # Gemma 3: per layer 'full_attention' or 'sliding_attention'; None: all full
    sliding_window: int = None  # a sliding layer's query sees itself and the sliding_window - 1 tokens before it
    rope_local_theta: float = None  # Gemma 3: the sliding layers' RoPE base
    query_pre_attn_scalar: float = None  # Gemma 3: attention scores scaled by its ** -0.5
    tie_word_embeddings: bool = True
    # the checkpoint's config.json, whose other keys save_pretrained writes back; not part of the architecture
    hf_config: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        self.n_inner = self.n_inner or 4 * self.n_embd

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        gpt2 = config.model_type == "gpt2"  # learned positions; the Llama family rotates q and k instead
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            **(dict(wpe=nn.Embedding(config.block_size, config.n_embd)) if gpt2 else {}),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:  # GPT-2, and the small Qwen and Llama-3.2 models
            self.transformer.wte.weight = self.lm_head.weight
        self.gradient_checkpointing = False  # train.py's: recompute each block in backward, keeping only its input
        self.decode_graphs = False  # train.py's cuda_graphs: generate replays its decode steps as graphs (engine.py)
        self.apply(self._init_weights)
        # GPT-2 paper: scale the residual projections by 1/sqrt(number of residual additions)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def check_length(self, T, what):
        """The one check that a sequence fits: GPT-2's positions end at block_size, RoPE models were trained to it."""
        if T > self.config.block_size:
            raise ValueError(f"{what}: {T} tokens, more than block_size {self.config.block_size}; shorten it or use a "
                             f"model with a larger block_size")

    def check_fits(self, enc, tokenizer, block_size):
        """A pretrained model fits the run: the tokenizer's ids within its vocabulary, block_size within its own."""
        if self.config.vocab_size < enc.n_vocab:
            raise ConfigError(f"the model's vocab_size {self.config.vocab_size} < tokenizer '{tokenizer}' n_vocab "
                              f"{enc.n_vocab}; pick the tokenizer the model was trained with")
        if self.config.block_size < block_size:
            raise ConfigError(f"block_size={block_size} exceeds the model's {self.config.block_size}; lower block_size")

    def configure_optimizer(self, *, lr, weight_decay, betas, fused):
        """AdamW over the trainable parameters (LoRA: the adapters), weight decay on matrices only (nanoGPT's
        choice); fused (CUDA) saves a kernel launch per parameter."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
                  dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)

    def get_num_params(self):
        """Parameters without the position embeddings (tied token embeddings count: they are the output layer)."""
        wpe = self.transformer.wpe.weight.numel() if "wpe" in self.transformer else 0
        return sum(p.numel() for p in self.parameters()) - wpe

    def flops_per_token(self, T, backward=True):
        """Model FLOPs for one token at context length T (PaLM appendix B, as nanoGPT's estimate_mfu): 2 per weight
        of a matmul (an untied input embedding is a lookup, not a matmul; grouped-query attention's smaller k and v
        and SwiGLU's third matrix are in the weights) plus 2*T per query-head channel per layer for the attention
        scores and as much for the mixing (a sliding layer's T at most its window); x3 with the backward pass."""
        cfg = self.config
        weights = self.get_num_params() - (0 if cfg.tie_word_embeddings else self.transformer.wte.weight.numel())
        spans = [min(T, cfg.sliding_window) if t == "sliding_attention" else T  # the keys a query sees
                 for t in cfg.layer_types or [None] * cfg.n_layer]
        forward = 2 * weights + 4 * cfg.n_head * cfg.head_dim * sum(spans)
        return 3 * forward if backward else forward

    def update_flops(self, rows, T, C):
        """Model FLOPs of a training step over `rows` sequences of T tokens with C completion positions each (on
        average: logprobs' lengths): the body runs over all T positions, the output layer only over the completion
        positions. A frozen weight (LoRA's base) gets no gradient of its own: 4 FLOPs per token in the step, not 6."""
        head = 6 * self.config.vocab_size * self.config.n_embd  # the output layer's share of flops_per_token
        frozen_head = 0 if self.lm_head.weight.requires_grad else head // 3
        frozen_body = sum(p.numel() for n, p in self.transformer.h.named_parameters() if not p.requires_grad)
        return rows * (T * (self.flops_per_token(T) - head - 2 * frozen_body) + C * (head - frozen_head))

    def hidden(self, idx, pos=None, kv=None, col=0, key_mask=None):
        """Final hidden states (B, T, C) of idx (B, T); kv, col and key_mask are generate()'s cache plumbing. pos
        (B, T) without kv: rows packed one after another (rollout.micro_batches; the mask is lib/packing.py's), each
        token's position in its own row."""
        cfg, T = self.config, idx.size(1)
        if pos is not None and kv is None:
            key_mask = packing.attention_mask(pos)  # (B, 1, T, T)
        if pos is None:
            self.check_length(T, "the sequence")
            pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx)  # (B, T, C)
        if cfg.model_type == "gemma3_text":  # Gemma: embeddings times sqrt(n_embd), rounded to float32, then theirs
            x = x * torch.tensor(cfg.n_embd ** 0.5).to(x.dtype)
        rope = local_rope = local_mask = None
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        else:  # cos and sin of each position's angles (B or 1, 1, T, hs), shared by every layer of a kind
            rope = rotary(cfg, pos, x.dtype)
        if cfg.layer_types:  # Gemma 3's sliding layers: a RoPE base and a key mask of their own
            local_rope, local_mask = rotary(cfg, pos, x.dtype, local=True), self.window_mask(pos, col, key_mask, kv)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            sliding = cfg.layer_types and cfg.layer_types[i] == "sliding_attention"
            r, m = (local_rope, local_mask) if sliding else (rope, key_mask)
            if self.gradient_checkpointing and kv is None and torch.is_grad_enabled():
                x = checkpoint(block, x, r, None, 0, m, use_reentrant=False)
            else:
                x = block(x, r, None if kv is None else kv[i], col, m)
        return self.transformer.ln_f(x)

    def window_mask(self, pos, col, key_mask, kv):
        """A sliding layer's key mask: key_mask (None: causal) less the keys sliding_window or more positions before
        the query. The cache holds every column for these layers too, as for the global ones: the mask hides the
        old ones (a row's cache columns are its positions, shifted by its left padding)."""
        w = self.config.sliding_window
        if kv is not None and torch.is_tensor(col):  # decoding: query t of row b sits in cache column col[b] + t
            q = col[:, None] + torch.arange(pos.size(-1), device=col.device)  # (B, T)
            return key_mask & (torch.arange(key_mask.size(-1), device=col.device) > q[..., None] - w)[:, None]
        near = pos[..., :, None] - pos[..., None, :] < w  # (T, T), or (B, T, T) packed
        if key_mask is None:  # one sequence, causal: a window only once it is longer than the window
            return near.tril() if pos.size(-1) > w else None
        return key_mask & near[:, None]  # (B, 1, T, T)

    def forward(self, idx, start=None, length=None, temperature=1.0, entropy=False, lengths=None, pos=None,
                plain=False, top_k=None, top_p=None):
        """Logits (B, T, vocab_size) of idx (B, T); given start, the trainer's log-probs instead (as nanoGPT's forward
        gives the loss given targets; DDP sees the trainer's pass because it goes through forward):
        out[b, j] = log softmax(logits / temperature) of token idx[b, start[b] + j], predicted from the position
        before it, for j < length: (B, length) float32 (float64 for a float64 model). idx (B, T): prompt +
        completion + right padding per row, start (B,) each row's prompt length. lengths (B,): how many completion
        tokens count (the output layer runs on those only; out is 0 past them). pos (B, T): rows packed (see hidden),
        start (n,) where each row's completion begins as a flat index into idx, out (n, length). plain=True: the
        reference, log_softmax(logits).gather; else the same numbers in chunks (lib/head.py), so a float32
        (B, T, vocab) tensor never exists. entropy=True returns (out, H), H the entropy of each softmax, both with
        gradients. top_k, top_p: the sampler's, for log q: the softmax renormalised over the tokens they keep."""
        if start is None:
            return self.lm_head(self.hidden(idx))
        B, T = idx.shape
        # checked when run eagerly; a compiled graph would break at the host sync
        if pos is None and not torch.compiler.is_compiling() and (int(start.min()) < 1 or
                                                                  int(start.max()) + length > T):
            raise ValueError(f"logprobs needs 1 <= start and start + length <= T, got start in "
                             f"[{int(start.min())}, {int(start.max())}], length {length}, T {T}")
        h = self.hidden(idx, pos)  # (B, T, C)
        if pos is None:  # one row a sequence: as a flat index into idx
            start = start + T * torch.arange(B, device=idx.device)
        n, j = len(start), torch.arange(length, device=idx.device)
        keep = (j < (length if lengths is None else lengths[:, None])).expand(n, -1)  # (n, length) those computed
        before = (start[:, None] + j - 1)[keep]  # (k,) flat index of the position before each target
        h, targets = h.flatten(0, 1)[before], idx.flatten()[before + 1]  # (k, C), (k,)
        if plain:  # the reference: all (k, vocab) logits at once, their log-softmax in float32 (or float64)
            logits = self.lm_head(h)
            z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
            if top_k is not None or top_p is not None:  # log q: the softmax over the tokens the sampler keeps
                z = truncate_(z, top_k, top_p, targets)
            logp = F.log_softmax(z, -1)  # (k, vocab)
            out = [logp.gather(1, targets[:, None]).squeeze(1)] + ([-(logp.exp() * logp).sum(-1)] if entropy else [])
        else:  # the same numbers a chunk of rows at a time, so that (k, vocab) float32 logits never exist
            out = head.logprobs(h, self.lm_head.weight, targets, temperature=temperature, entropy=entropy,
                                dtype=self.compute_dtype(), recompute=self.gradient_checkpointing, top_k=top_k,
                                top_p=top_p)
        out = [t.new_zeros(n, length).masked_scatter(keep, t) for t in out]  # (n, length) each
        return tuple(out) if entropy else out[0]

    logprobs = forward  # the log-prob pass by its name (without the hooks a call of the module runs)

    def compute_dtype(self):
        """The dtype the matmuls run in: autocast's when it is on, else the weights'."""
        dev = self.lm_head.weight.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.lm_head.weight.dtype

    def generate(self, prompts, max_new_tokens, *, num_samples=1, temperature=1.0, top_k=None, top_p=None,
                 eos_id=None, generator=None, turns=None, turn_workers=1, plain=False):
        """Sample num_samples completions for each prompt (a list of token-id lists): (tokens, mask, logprobs), each
        (N, L), N = len(prompts) * num_samples rows in prompt-major order, L <= max_new_tokens. A row ends at its
        first eos_id (one id or several), which it keeps; logprobs are each token's under the distribution it was
        drawn from, as logprobs() computes them; temperature=0 is greedy. turns: multi-turn observations. plain=True
        (one turn): sampling.generate, which reads every row whole again at each step; else engine.py's loop over a
        KV cache, the same draws. A method, not only a function, because FSDP registers it as an entry of the root
        (parallelism.shard): called first, before any forward, it must set up the sharded model as forward does."""
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: generate needs at least one prompt token to condition on")
            self.check_length(len(p) + max_new_tokens, f"prompt {i} ({len(p)} tokens) + max_new_tokens "
                              f"({max_new_tokens})")
        if turns is not None and eos_id is None:
            raise ValueError("turns needs eos_id: a turn ends where a row samples one of those ids; pass them as "
                             "eos_id")
        if not prompts or max_new_tokens < 1 or num_samples < 1 or temperature < 0:
            raise ValueError("generate needs at least one prompt, max_new_tokens >= 1, num_samples >= 1 and "
                             "temperature >= 0")
        check_sampling(top_k, top_p)
        was_training = self.training
        self.eval()  # no dropout while sampling
        try:
            args = dict(num_samples=num_samples, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
                        generator=generator)
            if plain and turns is None:
                return sampling.generate(self, prompts, max_new_tokens, **args)
            return engine.generate(self, prompts, max_new_tokens, turns=turns, turn_workers=turn_workers, **args)
        finally:
            self.train(was_training)

    def decode(self, tok, pos, kv, col, key_mask, u, temperature, top_k, top_p):
        """One step of generate: feed tok (n,) at positions pos (n,) into cache columns col (n,), and sample the next
        tokens and their log-probs (n,), (n,) with the uniforms u (n, 2). The shapes are the same from step to step
        (key_mask (n, S) and col hide padding and unwritten columns), so torch.compile makes the step one graph."""
        mask = key_mask & (torch.arange(key_mask.size(1), device=col.device) <= col[:, None])  # (n, S)
        h = self.hidden(tok[:, None], pos=pos[:, None], kv=kv, col=col, key_mask=mask[:, None, None])  # (n, 1, C)
        return sample(self.lm_head(h[:, -1]), temperature, top_k, top_p, u)

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None):
        """Load a Hugging Face checkpoint directory (lib/hf.py) or a .gguf file (lib/gguf_file.py dequantizes it to
        float32) in dtype (default: the checkpoint's own; a bf16 one upcasts exactly), then move it to device.
        device='meta': the model's shape only, no weights read (FSDP's ranks but the first)."""
        tensors = None
        if str(path).endswith('.gguf'):
            hf_config, tensors = gguf_file.read_model(path)
            fields, own_dtype = hf.parse_config(hf_config, path)
        else:
            fields, own_dtype = hf.read_config(path)
        if device == 'meta':
            with torch.device('meta'):
                return cls(GPTConfig(**fields)).to(dtype=dtype or own_dtype)
        model = cls(GPTConfig(**fields)).to(dtype=dtype or own_dtype)
        hf.load_weights(path, model.config, model.state_dict(), tensors)
        return model.to(device=device)

    def save_pretrained(self, path, max_shard_size=5 * 2**30, state_dict=None):
        """Write config.json and the weights in the Hugging Face layout of the model's family, each file atomically;
        above max_shard_size bytes the weights go into shards named by model.safetensors.index.json, as the hub's.
        state_dict: the weights to write if not the module's own (a sharded model's, gathered)."""
        os.makedirs(path, exist_ok=True)
        sd = self.state_dict() if state_dict is None else state_dict  # LoRA adapters go to lora.save_adapter
        hf.save_weights(path, self.config, {k: v for k, v in sd.items() if ".lora_" not in k}, max_shard_size)
        hf.write_config(path, self.config, self.lm_head.weight.dtype)
