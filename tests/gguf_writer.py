"""
Tiny GGUF files for the tests, written with the gguf package's own writer the way llama.cpp's converter writes a
model: llama.cpp's tensor names, a Llama's q and k rows reordered for its rotary kernel, norms in float32, the
matrices in the quantization asked for, the tokenizer as metadata. Written independently of gguf_file.py (which reads
them), so that a mistake in one is not repeated in the other. tests/fixtures/gguf/make_reference.py uses it too.
"""
import json
import os

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from model import GPT, GPTConfig

BPE = os.path.join(os.path.dirname(__file__), "fixtures", "tiny-bpe-a", "tokenizer.json")
NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
# where each K-quant block keeps its float16 scales (d, and dmin where it has one): set to small numbers, the rest of
# the block random, so that every dequantized weight is finite and modest
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_name(hf_name):
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight', 'lm_head.weight' -> 'output.weight'."""
    if hf_name.startswith("lm_head."):
        return "output." + hf_name.split(".")[-1]
    body, kind = hf_name.removeprefix("model.").rsplit(".", 1)
    if body.startswith("layers."):
        _, i, rest = body.split(".", 2)
        return f"blk.{i}.{NAMES[rest]}.{kind}"
    return f"{NAMES[body]}.{kind}"


def llama_cpp_order(w, heads):
    """llama.cpp's converter: each head's rows from (first half, second half) to the pairs side by side."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_quant(shape, qtype, rng):
    """Random blocks of K-quant qtype (gguf can read them but not write them) for a (rows, columns) matrix."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    for at in K_SCALES[qtype.name]:
        scale = rng.uniform(0.001, 0.004, size=data.shape[:2]).astype(np.float16)
        data[:, :, at:at + 2] = scale.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(shape[0], -1)


def tiny_model(arch, n_embd=64, n_inner=128, n_layer=1, vocab_size=544, head_dim=None, seed=0, tied=None):
    """A random Llama ('llama'), Qwen2 (q/k/v biases) or Qwen3 (q/k norms) of our own, in float32, 4 query heads
    and 2 key/value heads of head_dim (default n_embd / 4)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(model_type=arch, block_size=128, vocab_size=vocab_size, n_layer=n_layer, n_head=4, n_kv_head=2,
                    n_embd=n_embd, n_inner=n_inner, head_dim=head_dim or n_embd // 4, bias=False,
                    qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", norm_eps=1e-6, rope_theta=10000.0,
                    tie_word_embeddings=arch != "llama" if tied is None else tied)
    model = GPT(cfg)
    with torch.no_grad():  # biases and norm weights away from their zero / one init, so a mix-up shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_gguf(path, model, qtype="F32", reorder=True, drop=(), metadata=None, extra=None, tokenizer=BPE, pre="qwen2",
               seed=0):
    """model (a GPT of ours) as a GGUF at path: its Hugging Face tensors (save_pretrained's) renamed, the Llama's q/k
    rows reordered unless reorder=False (a planted mistake), matrices in qtype (1-D tensors stay F32), the tensors in
    `drop` left out, the float32 arrays `extra` {name: array} added, `metadata` {key: value} added or replacing the
    usual keys (None removes one)."""
    cfg, rng = model.config, np.random.default_rng(seed)
    folder = f"{path}.hf"
    model.save_pretrained(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    with open(tokenizer, encoding="utf-8") as f:
        tok = json.load(f)
    added = {t["id"]: t for t in tok["added_tokens"]}
    ids = {**tok["model"]["vocab"], **{t["content"]: i for i, t in added.items()}}
    tokens = sorted(ids, key=ids.get)
    arch = cfg.model_type
    keys = {f"{arch}.block_count": cfg.n_layer, f"{arch}.context_length": cfg.block_size,
            f"{arch}.embedding_length": cfg.n_embd, f"{arch}.feed_forward_length": cfg.n_inner,
            f"{arch}.attention.head_count": cfg.n_head, f"{arch}.attention.head_count_kv": cfg.n_kv_head,
            f"{arch}.attention.key_length": cfg.head_dim, f"{arch}.rope.freq_base": cfg.rope_theta,
            f"{arch}.attention.layer_norm_rms_epsilon": cfg.norm_eps, f"{arch}.vocab_size": cfg.vocab_size,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [(3 if added[i]["special"] else 4) if i in added else 1
                                          for i in range(len(tokens))],
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]],
            "tokenizer.ggml.eos_token_id": ids["<|im_end|>"], "tokenizer.ggml.bos_token_id": ids["<|endoftext|>"],
            **(metadata or {})}
    writer = gguf.GGUFWriter(path, keys.pop("general.architecture", arch))
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, t in tensors.items():
        name, w = gguf_name(name), t.float().numpy()
        if name in drop:
            continue
        if arch == "llama" and reorder and (".attn_q." in name or ".attn_k." in name):
            w = llama_cpp_order(w, cfg.n_head if ".attn_q." in name else cfg.n_kv_head)
        kind = gguf.GGMLQuantizationType[qtype if w.ndim == 2 else "F32"]
        if kind.name in K_SCALES:
            writer.add_tensor(name, random_k_quant(w.shape, kind, rng), raw_dtype=kind)
        elif kind.name.startswith("IQ"):  # never read: a type gguf_file refuses
            block, size = gguf.GGML_QUANT_SIZES[kind]
            writer.add_tensor(name, np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8), raw_dtype=kind)
        elif kind.name in ("F32", "F16"):
            writer.add_tensor(name, w.astype(np.float32 if kind.name == "F32" else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
