"""
The policy: one decoder-only transformer, as GPT-2 ('gpt2': learned positions,
LayerNorm, tanh-GELU, tied embeddings), the Llama family ('llama', 'qwen2', 'qwen3',
'mistral': rotary positions, RMSNorm, SwiGLU, grouped-query attention; Qwen2's q/k/v
biases, Qwen3's RMSNorm of each head's q and k) or Gemma 3 ('gemma3_text': Qwen3's
block with Gemma's changes, each marked "Gemma:"), with what GRPO needs:
1) logprobs() of given completions, chunked: no (B, T, vocab) float32 tensor;
2) generate(): many completions per prompt over a static KV cache (engine.py's
loop); 3) from_pretrained() and save_pretrained(): Hugging Face checkpoints without
transformers (lib/hf.py; module names are GPT2LMHeadModel's, the other families'
mapped), and from_pretrained() of GGUF (lib/gguf_file.py).
"""

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import engine
from sampling import draw_uniforms, eos_tensor, sample
from lib import gguf_file, head, hf, packing
from lib.parallelism import asked
from lib.truncation import truncate_

class RMSNorm(nn.Module):

    def __init__(self, dim, eps, gemma=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps, self.gemma = eps, gemma

    def forward(self, x):
        # statistics in float32 even under bf16 (float64 stays), cast back before the
        # weight (Llama)
        y = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)),
                       x.shape[-1:], eps=self.eps)
        # Gemma: the weight is stored as w and scales by 1 + w, before the cast back
        if self.gemma:
            return (y * (1.0 + self.weight.to(y.dtype))).type_as(x)
        return self.weight * y.type_as(x)

def norm(config, dim=None):
    if config.model_type == "gpt2":
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
    return RMSNorm(dim or config.n_embd, config.norm_eps,
                   gemma=config.model_type == "gemma3_text")

def rope_frequencies(config, device, local=False):
    """Rotary inverse frequencies (head_dim / 2,) float32, scaled per rope_scaling:
    'linear' divides all by factor (Gemma 3's global layers); Llama-3.1's stretches
    wavelengths above original_max_position_embeddings / low_freq_factor by factor,
    keeps those below it / high_freq_factor, blends between. local: Gemma 3's
    sliding layers' own base, unscaled."""
    hd = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, device=device).float() / hd)
    s = None if local else config.rope_scaling
    if s is None:
        return inv_freq
    if s.get("rope_type") == "linear":
        return inv_freq / s["factor"]
    ctx, lo, hi = (s["original_max_position_embeddings"], s["low_freq_factor"],
                   s["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    # 0: long wavelengths, 1: short ones
    smooth = ((ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)
    return (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq

def rotary(config, pos, dtype, local=False):
    """cos and sin (B or 1, 1, T, head_dim) of each position's rotary angles, in
    float32 first."""
    # (.., T, hs/2)
    angle = pos[..., None].float() * rope_frequencies(config, pos.device, local)
    angle = torch.cat((angle, angle), dim=-1).view(-1, 1, pos.size(-1), config.head_dim)
    return angle.cos().to(dtype), angle.sin().to(dtype)

def rotate(x, cos, sin):
    """Rotary embedding, rotate-half convention: each head's two halves, not
    interleaved pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin

class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.head_dim
        assert config.n_head % config.n_kv_head == 0
        # q, k, v for all heads in one matmul; with grouped-query attention k and v
        # have fewer heads
        qkv = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        self.c_attn = nn.Linear(config.n_embd, qkv, bias=config.bias or config.qkv_bias)
        self.c_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd,
                                bias=config.bias)
        # Qwen3, Gemma 3: each head's q and k RMS-normalised, before rotary
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm, self.k_norm = (norm(config, config.head_dim),
                                        norm(config, config.head_dim))
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        # Gemma: scores scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
        # (None: sdpa's)
        self.scale = (config.query_pre_attn_scalar
                      and config.query_pre_attn_scalar ** -0.5)

    def forward(self, x, rope=None, kv=None, col=0, key_mask=None):
        B, T, C = x.size()
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.c_attn(x).split([nh * hs, nkv * hs, nkv * hs], dim=2)
        q, k, v = q.view(B, T, nh, hs), k.view(B, T, nkv, hs), v.view(B, T, nkv, hs)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # (B, nh or nkv, T, hs)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        # kv: this layer's static cache, keys and values (rows, nkv, S, hs)
        # prefill of one prompt (B=1) into its rows
        if kv is not None and not torch.is_tensor(col):
            kv[0][:, :, col:col + T] = k
            kv[1][:, :, col:col + T] = v
        elif kv is not None:
            # decoding: row b's T tokens go into its cache from column col[b] on (a
            # tensor: the same shapes every step), in its dtype (under autocast q, k
            # are float32)
            at = col[:, None] + torch.arange(T, device=col.device)  # (B or 1, T)
            rows = torch.arange(B, device=col.device)[:, None]
            kv[0][rows, :, at] = k.transpose(1, 2).to(kv[0].dtype)  # (B, T, nkv, hs)
            kv[1][rows, :, at] = v.transpose(1, 2).to(kv[1].dtype)
            # key_mask (B, 1, T, S) hides padding and unwritten columns. The
            # g = nh // nkv query heads sharing kv head h // g are its queries: the
            # cache is read, never repeated
            g = nh // nkv
            # (B, 1, g * T, S)
            mask = key_mask.repeat(1, 1, g, 1) if T > 1 and g > 1 else key_mask
            q = q.reshape(B, nkv, g * T, hs).to(kv[0].dtype)
            y = F.scaled_dot_product_attention(q, *kv, attn_mask=mask, scale=self.scale)
            y = y.view(B, nkv, g, T, hs).permute(0, 3, 1, 2, 4).reshape(B, T, nh * hs)
            return self.resid_dropout(self.c_proj(y))
        # key_mask: packed rows' (B, 1, T, T) (a token sees its row and prompt) or a
        # window's (T, T)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=key_mask, is_causal=key_mask is None,
            enable_gqa=nkv != nh, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0)
        # all head outputs side by side
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.swiglu, self.gemma = (config.model_type != "gpt2",
                                   config.model_type == "gemma3_text")
        # the Llama family's MLP has no biases
        bias = config.bias and not self.swiglu
        # SwiGLU: gate and up in one matrix
        width = (2 if self.swiglu else 1) * config.n_inner
        self.c_fc = nn.Linear(config.n_embd, width, bias=bias)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd, bias=bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            # Gemma: the gate through tanh-GELU (GeGLU), not SiLU
            if self.gemma:
                return self.dropout(self.c_proj(F.gelu(gate, approximate="tanh") * up))
            return self.dropout(self.c_proj(F.silu(gate) * up))
        # GPT-2's GELU is tanh's (HF "gelu_new"); the exact erf GELU misses its logits
        # by ~1e-4
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))

class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)
        # Gemma: attention and MLP outputs normalised too
        self.post_norms = config.model_type == "gemma3_text"
        if self.post_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(config), norm(config)

    def forward(self, x, rope=None, kv=None, col=0, key_mask=None):
        y = self.attn(self.ln_1(x), rope, kv, col, key_mask)
        x = x + (self.post_attn_norm(y) if self.post_norms else y)
        y = self.mlp(self.ln_2(x))
        return x + (self.post_mlp_norm(y) if self.post_norms else y)

@dataclass
class GPTConfig:
    block_size: int = 1024
    # GPT-2's 50257 padded up to a multiple of 64 for efficiency
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    # GPT-2's Linears and LayerNorms; Llama: q, k, v, o (config's attention_bias)
    bias: bool = True
    # or 'llama', 'qwen2', 'qwen3', 'mistral', 'gemma3_text': see below
    model_type: str = "gpt2"
    n_kv_head: int = None  # grouped-query attention; None = n_head
    head_dim: int = None  # None = n_embd // n_head
    n_inner: int = None  # the MLP's hidden width; None = 4 * n_embd
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3.1's or {'rope_type': 'linear', ...}: see rope_frequencies
    rope_scaling: dict = None
    qkv_bias: bool = False  # Qwen2: biases in q, k, v only
    qk_norm: bool = False  # Qwen3, Gemma 3
    # Gemma 3: 'full_attention' or 'sliding_attention' each; None: full
    layer_types: tuple = None
    # a sliding layer's query sees itself and sliding_window - 1 before
    sliding_window: int = None
    rope_local_theta: float = None  # Gemma 3: the sliding layers' RoPE base
    # Gemma 3: attention scores scaled by its ** -0.5
    query_pre_attn_scalar: float = None
    tie_word_embeddings: bool = True
    # the checkpoint's config.json, whose other keys save_pretrained writes back; not
    # architecture
    hf_config: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        self.n_inner = self.n_inner or 4 * self.n_embd

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        # learned positions; the Llama family rotates q and k
        gpt2 = config.model_type == "gpt2"
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            **(dict(wpe=nn.Embedding(config.block_size, config.n_embd)) if gpt2 else {}),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # GPT-2, and the small Qwen and Llama-3.2 models
        if config.tie_word_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        # train.py's: backward recomputes each block
        self.gradient_checkpointing = False
        # train.py's cuda_graphs: decode steps replayed as graphs
        self.decode_graphs = False
        self.apply(self._init_weights)
        # GPT-2 paper: scale residual projections by 1/sqrt(number of residual additions)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0,
                                      std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def check_length(self, T, what):
        """The length check: GPT-2's positions end at block_size, RoPE models
        trained to it."""
        if T > self.config.block_size:
            raise ValueError(f"{what}: {T} tokens, more than block_size "
                             f"{self.config.block_size}; shorten it or use a model "
                             f"with a larger block_size")

    def configure_optimizer(self, *, lr, weight_decay, betas, fused):
        """AdamW over the trainable parameters (LoRA: the adapters), weight decay on
        matrices only (nanoGPT's choice); fused (CUDA) saves a kernel launch per
        parameter."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [dict(params=[p for p in params if p.dim() >= 2],
                       weight_decay=weight_decay),
                  dict(params=[p for p in params if p.dim() < 2],
                       weight_decay=0.0)]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)

    def get_num_params(self):
        """Parameters less position embeddings (tied token embeddings count: the
        output layer)."""
        wpe = self.transformer.wpe.weight.numel() if "wpe" in self.transformer else 0
        return sum(p.numel() for p in self.parameters()) - wpe

    def hidden(self, idx, pos=None, kv=None, col=0, key_mask=None):
        """Final hidden states (B, T, C) of idx (B, T); kv, col, key_mask:
        generate()'s cache. pos (B, T) without kv: packed rows
        (rollout.micro_batches), positions within a row."""
        cfg, T = self.config, idx.size(1)
        if pos is not None and kv is None:
            key_mask = packing.attention_mask(pos)  # (B, 1, T, T)
        if pos is None:
            assert T <= cfg.block_size, (
                f"{T} tokens, more than block_size {cfg.block_size}")
            pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx)  # (B, T, C)
        # Gemma: times sqrt(n_embd), rounded to float32 first
        if cfg.model_type == "gemma3_text":
            x = x * torch.tensor(cfg.n_embd ** 0.5).to(x.dtype)
        rope = local_rope = local_mask = None
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        else:
            # cos and sin (B or 1, 1, T, hs) of the positions' angles, for every
            # layer of a kind
            rope = rotary(cfg, pos, x.dtype)
        # Gemma 3's sliding layers: a RoPE base and a key mask of their own
        if cfg.layer_types:
            local_rope = rotary(cfg, pos, x.dtype, local=True)
            local_mask = self.window_mask(pos, col, key_mask, kv)
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
        """A sliding layer's key mask: key_mask (None: causal) less the keys
        sliding_window or more positions before the query. The cache holds all
        columns for these layers too: the mask hides the old ones (a row's cache
        columns are its positions, shifted by its left padding)."""
        w = self.config.sliding_window
        # decoding: row b's query t: column col[b] + t
        if kv is not None and torch.is_tensor(col):
            q = col[:, None] + torch.arange(pos.size(-1), device=col.device)  # (B, T)
            keys = torch.arange(key_mask.size(-1), device=col.device)  # (S,)
            return key_mask & (keys > q[..., None] - w)[:, None]
        near = pos[..., :, None] - pos[..., None, :] < w  # (T, T), or (B, T, T) packed
        # one sequence, causal: a window only once it is longer than one
        if key_mask is None:
            return near.tril() if pos.size(-1) > w else None
        return key_mask & near[:, None]  # (B, 1, T, T)

    def logits(self, idx):
        """Logits (B, T, vocab_size) of idx (B, T)."""
        return self.lm_head(self.hidden(idx))

    def forward(self, idx, start, length, temperature=1.0, entropy=False,
                lengths=None, pos=None, plain=False, top_k=None, top_p=None):
        """The trainer's pass, through forward so that DDP sees it (as nanoGPT's
        gives the loss): out[b, j] = log softmax(logits / temperature) of token
        idx[b, start[b] + j] (from the position before), j < length, (B, length)
        float32 (float64 for a float64 model). idx: prompt + completion + right
        padding per row; start (B,): prompt lengths; lengths (B,): the completion
        tokens that count (only those reach the output layer; out is 0 past them).
        pos (B, T): rows packed (see hidden), start (n,) indexes idx flattened, out
        (n, length). plain=True: the reference, log_softmax(logits).gather; else the
        same in chunks (lib/head.py). entropy=True: (out, H), H each softmax's
        entropy, with gradients. top_k, top_p: for log q."""
        B, T = idx.shape
        # a sync breaks a compiled graph
        check = pos is None and not torch.compiler.is_compiling()
        if check and (int(start.min()) < 1 or int(start.max()) + length > T):
            raise ValueError(f"logprobs needs 1 <= start and start + length <= T, "
                             f"got start in [{int(start.min())}, "
                             f"{int(start.max())}], length {length}, T {T}")
        h = self.hidden(idx, pos)  # (B, T, C)
        # one row a sequence: as a flat index into idx
        if pos is None:
            start = start + T * torch.arange(B, device=idx.device)
        n, j = len(start), torch.arange(length, device=idx.device)
        counted = length if lengths is None else lengths[:, None]
        keep = (j < counted).expand(n, -1)  # (n, length) the positions computed
        # (k,) flat index of the position before a target
        before = (start[:, None] + j - 1)[keep]
        h, targets = h.flatten(0, 1)[before], idx.flatten()[before + 1]  # (k, C), (k,)
        # the reference: all (k, vocab) logits at once, log-softmax in float32 (or 64)
        if plain:
            logits = self.lm_head(h)
            z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
            # log q: over the tokens sampling keeps
            if top_k is not None or top_p is not None:
                z = truncate_(z, top_k, top_p, targets)
            logp = F.log_softmax(z, -1)  # (k, vocab)
            out = [logp.gather(1, targets[:, None]).squeeze(1)]
            out += [-(logp.exp() * logp).sum(-1)] if entropy else []
        else:
            # the same numbers, a chunk of rows at a time: no (k, vocab) float32 logits
            out = head.logprobs(h, self.lm_head.weight, targets,
                                temperature=temperature, entropy=entropy,
                                dtype=self.compute_dtype(),
                                recompute=self.gradient_checkpointing,
                                top_k=top_k, top_p=top_p)
        # (n, length) each
        out = [t.new_zeros(n, length).masked_scatter(keep, t) for t in out]
        return tuple(out) if entropy else out[0]

    # the log-prob pass by its name (without the hooks a module call runs)
    logprobs = forward

    def compute_dtype(self):
        """The dtype the matmuls run in: autocast's when it is on, else the weights'."""
        dev, dtype = self.lm_head.weight.device.type, self.lm_head.weight.dtype
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else dtype

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, *, num_samples=1, temperature=1.0,
                 top_k=None, top_p=None, eos_id=None, generator=None, turns=None,
                 turn_workers=1, plain=False, max_rows=0):
        """
        Sample num_samples completions of each prompt (a list of token-id lists):
        (tokens, mask, logprobs), each (N, L), N = len(prompts) * num_samples rows
        (prompt-major), L <= max_new_tokens. A row ends at, and keeps, its first
        eos_id (an id or several); logprobs: each token's under the distribution it
        was drawn from, as logprobs() computes them; temperature=0: greedy; turns:
        multi-turn observations. plain=True (one turn) is the loop below, which
        engine.py's KV-cache loop (max_rows: at most that many rows decoded at once,
        0: all) is tested against: the same uniforms from the same generator, the
        same sample(), so the tokens are bitwise comparable. A method so that FSDP
        makes it a root entry (parallelism.shard). Unchecked here: a caller runs
        sampling.check_generate once.
        """
        was_training = self.training
        self.eval()  # no dropout while sampling
        try:
            if not plain or turns is not None:
                return engine.generate(
                    self, prompts, max_new_tokens, num_samples=num_samples,
                    temperature=temperature, top_k=top_k, top_p=top_p,
                    eos_id=eos_id, generator=generator, turns=turns,
                    turn_workers=turn_workers, max_rows=max_rows)
            # The plain sampler: no cache, each step reads every row whole again
            # (right-padded: causal attention never looks at the padding) and samples
            # at its newest token.
            device = self.lm_head.weight.device
            uniforms = draw_uniforms(generator, max_new_tokens, len(prompts),
                                     num_samples, device)
            rows = [p for p in prompts for _ in range(num_samples)]  # prompt-major
            eos = eos_tensor(eos_id, device)
            # what a row holds after its end
            fill = 0 if eos is None else int(eos[0])
            idx = torch.full((len(rows), max(map(len, rows)) + max_new_tokens),
                             fill, device=device)
            for i, row in enumerate(rows):
                idx[i, :len(row)] = torch.tensor(row)
            newest = torch.tensor([len(row) - 1 for row in rows], device=device)  # (N,)
            every_row = torch.arange(len(rows), device=device)
            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            tokens, mask, logps = [], [], []
            for step in range(max_new_tokens):
                h = self.hidden(idx[:, :int(newest.max()) + 1])  # (N, T, C)
                logits = self.lm_head(h[every_row, newest])  # (N, vocab_size)
                tok, logp = sample(logits, temperature, top_k, top_p, uniforms[step])
                tokens.append(tok.masked_fill(done, fill))
                logps.append(logp.masked_fill(done, 0.0))
                mask.append(~done)
                newest = newest + 1
                idx[every_row, newest] = tokens[-1]
                # a row keeps its eos, and ends there
                if eos is not None:
                    done = done | torch.isin(tok, eos)
                # a stop signal: the run drops what this call samples, so end here
                if done.all() or asked['signal']:
                    break
            return torch.stack(tokens, 1), torch.stack(mask, 1), torch.stack(logps, 1)
        finally:
            self.train(was_training)

    def decode(self, tok, pos, kv, col, key_mask, u, temperature, top_k, top_p):
        """One step of generate: feed tok (n,) at positions pos (n,) into cache
        columns col (n,), sample next tokens and log-probs (n,), (n,) with uniforms
        u (n, 2). key_mask (n, S) and col hide padding and unwritten columns: fixed
        shapes, so torch.compile makes one graph."""
        mask = key_mask & (torch.arange(key_mask.size(1), device=col.device)
                           <= col[:, None])
        h = self.hidden(tok[:, None], pos=pos[:, None], kv=kv, col=col,
                        key_mask=mask[:, None, None])  # (n, 1, C)
        return sample(self.lm_head(h[:, -1]), temperature, top_k, top_p, u)

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None):
        """Load a Hugging Face checkpoint directory (lib/hf.py) or a .gguf file
        (lib/gguf_file.py, in float32) in dtype (default: the checkpoint's; bf16
        upcasts exactly), then move it to device. device='meta': the shape only, no
        weights read (FSDP's ranks but the first)."""
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
        """Write config.json and the weights in the Hugging Face layout of the
        model's family, each file atomically, sharded above max_shard_size bytes
        (model.safetensors.index.json). state_dict: the weights if not the module's
        own (a sharded model's, gathered)."""
        os.makedirs(path, exist_ok=True)
        sd = self.state_dict() if state_dict is None else state_dict
        # adapters: lora.save_adapter
        sd = {k: v for k, v in sd.items() if ".lora_" not in k}
        hf.save_weights(path, self.config, sd, max_shard_size)
        hf.write_config(path, self.config, self.lm_head.weight.dtype)
