"""
The policy: a GPT-2 (learned positions, pre-LayerNorm, tanh-GELU MLP, tied embeddings) with the three things a GRPO
trainer needs from it:
1) logprobs(): per-token log-probs of given completions, chunked so a (B, T, vocab) float32 tensor never exists,
2) generate(): fast sampling of many completions per prompt with a static KV cache,
3) from_pretrained() / save_pretrained(): the Hugging Face GPT-2 checkpoint layout, without transformers.
Module names follow Hugging Face's GPT2LMHeadModel so checkpoints map key by key.
"""

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from safetensors import SafetensorError
from safetensors.torch import load_file, save

# HF stores these as Conv1D weights, (in, out): the transpose of an nn.Linear weight
_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x, kv=None, col=0, key_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        # kv: this layer's static cache, keys and values (rows, nh, S, hs)
        if kv is not None and key_mask is None:  # prefill of one prompt (B=1): broadcast into its sample rows
            kv[0][:, :, col:col + T] = k
            kv[1][:, :, col:col + T] = v
        elif kv is not None:  # decoding: col is a tensor, so every step runs the same shapes; key_mask hides
            kv[0].index_copy_(2, col, k)  # the columns not written yet
            kv[1].index_copy_(2, col, v)
            k, v = kv  # (B, nh, S, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=key_mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        # GPT-2's GELU is the tanh approximation (HF "gelu_new"); the exact erf GELU would miss its logits by ~1e-4
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))

class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv=None, col=0, key_mask=None):
        x = x + self.attn(self.ln_1(x), kv, col, key_mask)
        return x + self.mlp(self.ln_2(x))

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # bias in Linears and LayerNorms, like GPT-2; False is a bit better and faster

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
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

    def get_num_params(self):
        """Parameters without the position embeddings (the token embeddings count: they are the output layer)."""
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def flops_per_token(self, T, backward=True):
        """Model FLOPs for one token at context length T (PaLM appendix B, as nanoGPT's estimate_mfu): 2 per weight
        for the matmuls plus 4*T*C per layer for attention scores and mixing; x3 with the backward pass (2x forward)."""
        cfg = self.config
        forward = 2 * self.get_num_params() + 4 * cfg.n_layer * cfg.n_embd * T
        return 3 * forward if backward else forward

    def _hidden(self, idx, pos=None, kv=None, col=0, key_mask=None):
        """Final hidden states (B, T, C) of idx (B, T); pos, kv, col and key_mask are generate()'s cache plumbing."""
        T = idx.size(1)
        if pos is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}; "
                                 f"truncate it or use a model with a larger block_size")
            pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if kv is None else kv[i], col, key_mask)
        return self.transformer.ln_f(x)

    def forward(self, idx, start=None, length=None, temperature=1.0):
        """Logits (B, T, vocab_size) for every position of idx (B, T): the plain reference path. Given start and
        length it returns logprobs(idx, start, length, temperature) instead, so that the trainer's pass goes
        through forward and a DistributedDataParallel wrapper sees it."""
        if start is not None:
            return self.logprobs(idx, start, length, temperature)
        return self.lm_head(self._hidden(idx))

    def logprobs(self, idx, start, length, temperature=1.0):
        """out[b, j] = log softmax(logits / temperature) of token idx[b, start[b] + j], predicted from the position
        before it, for j < length: (B, length) float32. idx (B, T) holds prompt + completion + any right padding
        per row (causal attention never looks at the padding), start (B,) each row's prompt length. The output layer
        runs in chunks of rows, recomputed in backward, so a float32 (B, T, vocab) tensor never exists."""
        B, T = idx.shape
        # checked when run eagerly; a compiled graph would break at the host sync
        if not torch.compiler.is_compiling() and (int(start.min()) < 1 or int(start.max()) + length > T):
            raise ValueError(f"logprobs needs 1 <= start and start + length <= T, got start in "
                             f"[{int(start.min())}, {int(start.max())}], length {length}, T {T}")
        h = self._hidden(idx)  # (B, T, C)
        pos = start[:, None] + torch.arange(length, device=idx.device) - 1  # (B, length) position before each target
        h = h.gather(1, pos[..., None].expand(-1, -1, h.size(-1))).flatten(0, 1)  # (B*length, C)
        targets = idx.gather(1, pos + 1).flatten()  # (B*length,)
        rows = max(1, 2**24 // self.config.vocab_size)  # each chunk's float32 logits stay near 64 MB
        out = []
        for i in range(0, targets.numel(), rows):
            args = (h[i:i + rows], targets[i:i + rows], temperature)
            # in training, keep only the chunk's hidden states for backward and recompute its logits there
            out.append(checkpoint(self._token_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled()
                       else self._token_logprobs(*args))
        return torch.cat(out).view(B, length)

    def _token_logprobs(self, h, targets, temperature):
        logits = self.lm_head(h).float()  # (n, V) float32 even under autocast: the normaliser needs it
        if temperature != 1:
            logits = logits / temperature
        return logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)  # (n,) faster than logsumexp on CPU

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens, *, num_samples=1, temperature=1.0, top_k=None, top_p=None,
                 eos_id=None, generator=None):
        """Sample num_samples completions for each prompt (a list of token-id lists of any lengths).
        Returns (tokens, mask, logprobs), each (N, L) with N = len(prompts) * num_samples rows in prompt-major order
        and L <= max_new_tokens the steps taken. A row ends at its first eos_id, which it keeps; after it tokens are
        eos_id (0 if None), mask is False and logprobs 0. logprobs is the log-prob of each token under the full
        softmax(logits / temperature), the same number logprobs() computes, so the on-policy ratio is exactly 1;
        top_k/top_p only restrict which tokens can be drawn (see sample). temperature=0 is greedy, with log-probs
        reported at temperature 1. generator: one torch.Generator for the whole batch, or a list of one per prompt,
        whose draws then depend on nothing else: a prompt gets the same samples alone or in any batch.

        Each prompt is prefilled once, straight into the cache rows of its samples, right-aligned so that every row
        then decodes at the same cache column; a per-row key mask hides the left padding."""
        lengths = [len(p) for p in prompts]
        for i, n in enumerate(lengths):
            if n == 0:
                raise ValueError(f"prompt {i} is empty: generate needs at least one prompt token to condition on")
            if n + max_new_tokens > self.config.block_size:
                raise ValueError(f"prompt {i} has {n} tokens and max_new_tokens is {max_new_tokens}, more than "
                                 f"block_size {self.config.block_size}: shorten the prompt or lower max_new_tokens")
        if not prompts or max_new_tokens < 1 or num_samples < 1 or temperature < 0:
            raise ValueError("generate needs at least one prompt, max_new_tokens >= 1, num_samples >= 1 and "
                             "temperature >= 0")
        if (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
            raise ValueError(f"top_k must be >= 1 and top_p in (0, 1], got top_k={top_k} top_p={top_p}")
        was_training = self.training
        self.eval()
        try:
            return self._generate(prompts, max_new_tokens, num_samples, temperature, top_k, top_p, eos_id, generator)
        finally:
            self.train(was_training)

    def _generate(self, prompts, max_new_tokens, G, temperature, top_k, top_p, eos_id, generator):
        cfg, dev = self.config, self.lm_head.weight.device
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else self.lm_head.weight.dtype
        N, P = len(prompts) * G, max(len(p) for p in prompts)
        S = P + max_new_tokens - 1  # the last sampled token is never fed back
        lens = torch.tensor([len(p) for p in prompts], device=dev).repeat_interleave(G)  # (N,)
        # each layer's keys and values (N, nh, S, hs), two tensors that a compiled decode can update in place; zeros,
        # not empty: masked columns get attention weight 0, and 0 * NaN garbage would still be NaN
        kv = [[torch.zeros(N, cfg.n_head, S, cfg.n_embd // cfg.n_head, dtype=dtype, device=dev) for _ in "kv"]
              for _ in range(cfg.n_layer)]
        rows_of = lambda r: [(k[r], v[r]) for k, v in kv]  # the cache of some rows: a slice (view) or a gather
        key_mask = torch.arange(S, device=dev) >= (P - lens)[:, None]  # (N, S) False on each row's left padding
        logits = torch.empty(N, cfg.vocab_size, device=dev)
        for i, p in enumerate(prompts):
            rows = slice(i * G, (i + 1) * G)
            h = self._hidden(torch.tensor(p, device=dev)[None], kv=rows_of(rows), col=P - len(p))  # (1, len, C)
            logits[rows] = self.lm_head(h[:, -1])  # one row of logits, which each sample row draws from on its own

        # every uniform the sampler will use, drawn up front: two per row and step (see _draw)
        if isinstance(generator, (list, tuple)):
            if len(generator) != len(prompts):
                raise ValueError(f"{len(generator)} generators for {len(prompts)} prompts; give one per prompt")
            u = torch.cat([torch.rand(max_new_tokens, G, 2, device=dev, generator=g) for g in generator], 1)
        else:
            u = torch.rand(max_new_tokens, N, 2, device=dev, generator=generator)  # (steps, N, 2)
        fill = 0 if eos_id is None else eos_id
        tokens = torch.full((max_new_tokens, N), fill, device=dev)  # step-major: each step writes one row
        logps = torch.zeros(max_new_tokens, N, device=dev)
        live = torch.arange(N, device=dev)  # output row of each batch row; the batch shrinks as rows finish
        done = torch.zeros(N, dtype=torch.bool, device=dev)
        cols = torch.arange(P, S, device=dev)  # the cache column of each step's input token, the same for every row
        check_every = 8  # steps between the only host syncs of the loop: "all done?" and compaction
        tok, lp = sample(logits, temperature, top_k, top_p, u[0])  # (N,), (N,)
        for t in range(max_new_tokens):
            tokens[t].index_copy_(0, live, tok.masked_fill(done, fill))
            logps[t].index_copy_(0, live, lp.masked_fill(done, 0.0))
            if eos_id is not None:
                done = done | (tok == eos_id)
            if t == max_new_tokens - 1:
                break
            if t % check_every == check_every - 1:
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                if keep.numel() <= 0.75 * done.numel():  # drop finished rows, but not for a few: it copies the cache
                    kv, live, lens, key_mask = rows_of(keep), live[keep], lens[keep], key_mask[keep]
                    tok, done = tok[keep], done[keep]
            tok, lp = self.decode(tok, lens + t, kv, cols[t:t + 1], key_mask, u[t + 1].index_select(0, live),
                                  temperature, top_k, top_p)

        tokens, logps = tokens.t(), logps.t()  # (N, max_new_tokens)
        if eos_id is None:
            mask = torch.ones_like(tokens, dtype=torch.bool)
        else:  # real tokens: no eos strictly before them (rows end with eos, then are filled with it)
            is_eos = (tokens == eos_id).int()
            mask = (is_eos.cumsum(1) - is_eos) == 0
        L = int(mask.any(0).sum())  # rows only ever end, so the steps with a live row are a prefix
        return tokens[:, :L].contiguous(), mask[:, :L].contiguous(), logps[:, :L].contiguous()

    def decode(self, tok, pos, kv, col, key_mask, u, temperature, top_k, top_p):
        """One step of generate: feed tok (n,) at positions pos (n,), its keys and values going into cache column col
        (a one-element tensor: every row's newest token sits in the same column), and sample the next tokens and
        their log-probs (n,), (n,) with the uniforms u (n, 2). The shapes are the same at every step (attention
        covers the whole cache; key_mask (n, S) and col hide the padding and what is not written yet), so
        torch.compile turns the step, sampling included, into one graph: train.py's compile does."""
        mask = key_mask & (torch.arange(key_mask.size(1), device=col.device) <= col)  # (n, S)
        h = self._hidden(tok[:, None], pos=pos[:, None], kv=kv, col=col, key_mask=mask[:, None, None])  # (n, 1, C)
        return sample(self.lm_head(h[:, -1]), temperature, top_k, top_p, u)

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None):
        """Load a Hugging Face GPT-2 directory (config.json + model.safetensors, any size) in dtype (default
        float32; the weights are copied into parameters of that dtype, so a float64 checkpoint loads exactly), then
        move it to device if given."""
        config_file, weights_file = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
        for f in (config_file, weights_file):
            if not os.path.isfile(f):
                raise FileNotFoundError(f"{f} not found: from_pretrained needs a Hugging Face GPT-2 directory "
                                        f"with config.json and model.safetensors")
        with open(config_file) as f:
            hf = json.load(f)
        if hf.get("model_type") != "gpt2":
            raise ValueError(f"{config_file}: model_type is {hf.get('model_type')!r}, only 'gpt2' checkpoints load")
        hf.setdefault("n_positions", hf.get("n_ctx"))  # the oldest configs name the context length n_ctx only
        keys = dict(block_size="n_positions", vocab_size="vocab_size", n_layer="n_layer", n_head="n_head",
                    n_embd="n_embd")
        missing = [k for k in keys.values() if hf.get(k) is None]
        if missing:
            raise ValueError(f"{config_file}: missing key {missing[0]!r}")
        # settings that would change the maths this GPT does
        if (hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh")
                or hf.get("layer_norm_epsilon", 1e-5) != 1e-5 or hf.get("n_inner") not in (None, 4 * hf["n_embd"])
                or hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("tie_word_embeddings", True)):
            raise ValueError(f"{config_file}: unsupported GPT-2 variant (needs activation gelu_new, "
                             f"layer_norm_epsilon 1e-5, n_inner 4*n_embd, tied embeddings, unscaled attention)")
        model = cls(GPTConfig(**{ours: hf[theirs] for ours, theirs in keys.items()}, bias=True)).to(dtype=dtype)

        ours = model.state_dict()  # shares storage with the parameters
        try:
            tensors, loaded = load_file(weights_file), set()
        except SafetensorError as e:  # truncated or not a safetensors file at all
            raise ValueError(f"{weights_file} cannot be read ({e}); the file is damaged or not safetensors: "
                             f"restore it or save the model again") from None
        for key, t in tensors.items():
            name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key  # old files: no prefix
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # HF's causal-mask buffers; the tied output layer is checked below
            if name not in ours:
                raise ValueError(f"{weights_file}: unexpected tensor {key!r}, not part of a GPT-2 of its config.json")
            t = t.t() if name.endswith(_TRANSPOSED) else t
            if t.shape != ours[name].shape:
                raise ValueError(f"{weights_file}: tensor {key!r} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(ours[name].shape)} from config.json")
            ours[name].copy_(t)
            loaded.add(name)
        missing = sorted(set(ours) - loaded - {"lm_head.weight"})
        if missing:
            raise ValueError(f"{weights_file}: missing tensor {missing[0]!r}")
        head = tensors.get("lm_head.weight")
        if head is not None and not torch.equal(head.to(ours["lm_head.weight"].dtype), ours["lm_head.weight"]):
            raise ValueError(f"{weights_file}: lm_head.weight differs from transformer.wte.weight; "
                             f"only GPT-2 with tied embeddings is supported")
        return model.to(device=device)

    def save_pretrained(self, path):
        """Write config.json + model.safetensors in the Hugging Face GPT-2 layout, each file atomically. HF GPT-2
        always has biases, so a bias=False model is saved with zero biases: the same function, loaded as bias=True."""
        cfg = self.config
        tensors = {name: (t.t() if name.endswith(_TRANSPOSED) else t).detach().contiguous().cpu()
                   for name, t in self.state_dict().items() if name != "lm_head.weight"}  # tied: HF re-ties it
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)) and m.bias is None and name != "lm_head":
                tensors[name + ".bias"] = torch.zeros(m.weight.shape[0], dtype=m.weight.dtype)
        hf = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], activation_function="gelu_new",
                  n_positions=cfg.block_size, n_ctx=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                  n_head=cfg.n_head, n_inner=None, vocab_size=cfg.vocab_size, layer_norm_epsilon=1e-5,
                  tie_word_embeddings=True, initializer_range=0.02, attn_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                  resid_pdrop=cfg.dropout, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  reorder_and_upcast_attn=False, use_cache=True,
                  torch_dtype=str(self.lm_head.weight.dtype).removeprefix("torch."))
        os.makedirs(path, exist_ok=True)
        _atomic_write(os.path.join(path, "model.safetensors"), save(tensors, metadata={"format": "pt"}))
        _atomic_write(os.path.join(path, "config.json"), (json.dumps(hf, indent=2, sort_keys=True) + "\n").encode())

def _atomic_write(file, data):
    # a crash mid-save leaves the old file or the new one, never half of one
    tmp = f"{file}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)

# -----------------------------------------------------------------------------
# sampling

def sample(logits, temperature=1.0, top_k=None, top_p=None, u=None):
    """Draw one token per row of logits (B, V) from softmax(logits / temperature), restricted to the top_k most
    likely tokens and then to the smallest set of them holding top_p of their mass, and return (tokens (B,) long,
    log-probs (B,) float32). The log-prob is under the full temperature softmax, not the restricted one: the
    policy's own probability, as logprobs() computes it. temperature=0 is greedy (log-probs at temperature 1).
    top_p without top_k sorts the whole vocabulary, which is slow on CPU; a top_k as well keeps it cheap.
    u (B, 2): the two uniforms in [0, 1) each row's draw uses; by default from torch's global generator."""
    x = logits.float()
    u = torch.rand(x.size(0), 2, device=x.device) if u is None else u
    if temperature not in (0, 1):
        x = x / temperature
    p = torch.softmax(x, -1)  # (B, V) one fused pass; an exp of its own is several times slower on CPU
    if temperature == 0:
        tok = x.argmax(-1, keepdim=True)
    elif top_k is None and top_p is None:
        tok = _draw(p, u)
    else:
        # candidates sorted by probability, so the top_p cut is a prefix
        w, idx = p.topk(min(top_k, p.size(-1))) if top_k is not None else p.sort(-1, descending=True)  # (B, k)
        if top_p is not None:  # keep a token while the mass before it is < top_p of the candidates' mass
            w = w.masked_fill(w.cumsum(-1) - w >= top_p * w.sum(-1, keepdim=True), 0.0)
        tok = idx.gather(1, _draw(w, u))
    return tok.squeeze(1), p.gather(1, tok).log().squeeze(1)

def _draw(w, u):
    """Exact inverse-CDF draw of one index (B, 1) per row of nonnegative weights w (B, V). A cumsum over the whole
    vocabulary is slow (it is sequential), so draw in two levels: a block of ~sqrt(V) tokens by its mass, then a
    token inside the block by its weight, each with its own uniform of u (B, 2): ~200x cheaper than torch.multinomial at
    64 x 50304 on a CPU core."""
    B, V = w.shape
    bs = math.isqrt(V - 1) + 1  # block size
    full = V // bs * bs
    mass = torch.cat([w[:, :full].view(B, -1, bs).sum(-1), w[:, full:].sum(-1, keepdim=True)], 1)  # (B, nb)
    block = _search(mass.cumsum(-1), u[:, :1])  # (B, 1)
    cols = block * bs + torch.arange(bs, device=w.device)  # (B, bs) the block's token ids
    inside = w.gather(1, cols.clamp(max=V - 1)).masked_fill(cols >= V, 0.0)  # (B, bs) the last block may be short
    return block * bs + _search(inside.cumsum(-1), u[:, 1:])

def _search(cdf, u):
    """Index i with cdf[i-1] <= u * total < cdf[i], so entries of zero mass are never hit."""
    total = cdf[:, -1:].contiguous()  # (B, 1)
    i = torch.searchsorted(cdf, u * total, right=True)
    # u * total can round up to total: then take the last entry with positive mass
    return torch.minimum(i, torch.searchsorted(cdf, total))
