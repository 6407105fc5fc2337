"""
Tiny GGUF files for the tests, written with the gguf package's own writer the way llama.cpp's converter
(convert_hf_to_gguf.py and the gguf package's SpecialVocab) writes a model: llama.cpp's tensor names, a Llama's q and
k rows reordered for its rotary kernel, norms in float32, the matrices in the quantization asked for, and the
tokenizer as the converter lists it from a family's Hugging Face files (HUBS): a token for every embedding row, with
[PAD{id}] tokens of type UNUSED where the tokenizer has none (Qwen's 151,936 rows hold 151,665 tokens), the token
types, tokenizer.ggml.pre, the bos/eos/padding ids, add_bos_token and the chat template. Written independently of
lib/gguf_file.py (which reads them), so that a mistake in one is not repeated in the other.
tests/fixtures/gguf/make_reference.py uses it too.
"""
import json
import os

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from model import GPT, GPTConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
BPE = os.path.join(FIXTURES, "tiny-bpe-a", "tokenizer.json")  # Qwen2.5's layout: 541 BPE tokens, 3 special ones


def _template(name):
    """A family's real chat template (tests/fixtures/chat_templates: TRL's byte-exact copies)."""
    with open(os.path.join(FIXTURES, "chat_templates", f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


QWEN25_TEMPLATE, QWEN3_TEMPLATE = _template("qwen2_5"), _template("qwen3")
LLAMA3_TEMPLATE = _template("llama3_1")
# Llama-3's pre-tokenizer regex (its tokenizer.json's Split), and its special tokens after the BPE vocabulary
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
# Qwen3's added tokens that are not special, in its order (<|fim_prefix|> stands for the six <|fim_...|>-like ones)
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<think>", "</think>"]
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType
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


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _added(i, content, special):
    return dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                special=special)


def qwen3_tokenizer():
    """tiny-bpe-a with Qwen3's added tokens that are not special after its three special ones (ids 544-548)."""
    tok = _load(BPE)
    tok["added_tokens"] += [_added(544 + k, s, False) for k, s in enumerate(QWEN3_ADDED)]
    return tok


def llama3_tokenizer():
    """tiny-bpe-a's BPE in Llama-3's tokenizer.json layout: no normalizer, Llama-3's regex (digits in threes),
    ignore_merges and a merge for every two-token split of each token, sorted by the merged token's id (Llama-3's
    were made from tiktoken ranks), its special tokens after the BPE vocabulary (541-551), and a post-processor that
    opens each text with <|begin_of_text|>."""
    tok = _load(BPE)
    vocab = tok["model"]["vocab"]
    splits = sorted((vocab[s], f"{s[:k]} {s[k:]}") for s in vocab for k in range(1, len(s))
                    if s[:k] in vocab and s[k:] in vocab)
    tok["model"].update(merges=[m for _, m in splits], ignore_merges=True)
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": LLAMA3_REGEX}
    tok["normalizer"], tok["added_tokens"] = None, [_added(541 + k, s, True) for k, s in enumerate(LLAMA3_SPECIAL)]
    bos = dict(SpecialToken=dict(id="<|begin_of_text|>", type_id=0))
    tok["post_processor"] = dict(type="Sequence", processors=[tok["post_processor"], dict(
        type="TemplateProcessing", single=[bos, dict(Sequence=dict(id="A", type_id=0))],
        pair=[bos, dict(Sequence=dict(id="A", type_id=0)), bos, dict(Sequence=dict(id="B", type_id=1))],
        special_tokens={"<|begin_of_text|>": dict(id="<|begin_of_text|>", ids=[541], tokens=["<|begin_of_text|>"])})])
    return tok


# each family's Hugging Face files as the converter reads them: tokenizer.json, tokenizer.ggml.pre (which the
# converter finds from how the tokenizer splits a test text), tokenizer_config.json's keys and config.json's token
# ids (the tiny tokenizers' ids for the real ones': Qwen's bos 151643 and eos 151645, Llama-3.x's bos 128000 and eos
# [128001, 128008, 128009], a list, which SpecialVocab skips). Qwen's files say add_bos_token false (their GGUFs
# carry it); Llama-3's post-processor says true.
QWEN = dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", add_bos_token=False)
HUBS = {
    "qwen2.5": dict(tokenizer=lambda: _load(BPE), pre="qwen2", config=dict(QWEN, chat_template=QWEN25_TEMPLATE),
                    ids=dict(bos_token_id=541, eos_token_id=543)),
    "qwen3": dict(tokenizer=qwen3_tokenizer, pre="qwen2",
                  config=dict(QWEN, chat_template=QWEN3_TEMPLATE),
                  ids=dict(bos_token_id=541, eos_token_id=543)),
    "llama3": dict(tokenizer=llama3_tokenizer, pre="llama-bpe",
                   config=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE),
                   ids=dict(bos_token_id=541, eos_token_id=[542, 549, 550])),
}


def llama_cpp_vocab(tok, vocab_size):
    """(tokens, token types) as the converter lists tokenizer.json tok for a model of vocab_size embedding rows
    (get_vocab_base): an id the tokenizer lacks is [PAD{id}] of type UNUSED; an added token is CONTROL when special
    or looking it (<|...|>), else USER_DEFINED; the BPE vocab is NORMAL."""
    added = {t["id"]: t for t in tok["added_tokens"]}
    text = {i: s for s, i in tok["model"]["vocab"].items()}
    assert max([*added, *text]) < vocab_size  # the converter's own assertion
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            content = added[i]["content"]
            looks = content.startswith("<|") and content.endswith("|>")  # (and <｜...｜>, <unused..>, for others)
            tokens.append(content)
            types.append(CONTROL if added[i]["special"] or looks else USER_DEFINED)
        else:
            tokens.append(text.get(i, f"[PAD{i}]"))
            types.append(NORMAL if i in text else UNUSED)
    return tokens, types


def special_vocab(tok, config, ids):
    """The keys gguf's SpecialVocab adds from a checkpoint's files: the merges as 'a b' strings, the id of each of
    the bos, eos and padding tokens that tokenizer_config.json names, else config.json's where that is one int,
    add_bos_token from a TemplateProcessing post-processor that opens with the bos token, then from
    tokenizer_config.json, and its chat template."""
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    keys = {"tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]}
    for kind, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        i = added.get(config.get(f"{kind}_token"), ids.get(f"{kind}_token_id"))
        if isinstance(i, int):
            keys[f"tokenizer.ggml.{key}_token_id"] = i
    post = tok.get("post_processor") or {}
    for p in post.get("processors", [post]):
        if p.get("type") == "TemplateProcessing" and len(p["single"]) > 1 and "SpecialToken" in p["single"][0]:
            keys["tokenizer.ggml.add_bos_token"] = p["single"][0]["SpecialToken"]["id"] == config.get("bos_token")
    if "add_bos_token" in config:
        keys["tokenizer.ggml.add_bos_token"] = config["add_bos_token"]
    if config.get("chat_template"):
        keys["tokenizer.chat_template"] = config["chat_template"]
    return keys


def write_gguf(path, model, qtype="F32", reorder=True, drop=(), metadata=None, extra=None, hub="qwen2.5", pre=None,
               seed=0):
    """model (a GPT of ours) as a GGUF at path, with family `hub`'s tokenizer (HUBS) padded to the model's
    vocab_size: its Hugging Face tensors (save_pretrained's) renamed, the Llama's q/k rows reordered unless
    reorder=False (a planted mistake), matrices in qtype (1-D tensors stay F32), the tensors in `drop` left out, the
    float32 arrays `extra` {name: array} added, `metadata` {key: value} added or replacing the usual keys (None
    removes one), pre replacing the family's tokenizer.ggml.pre."""
    cfg, rng = model.config, np.random.default_rng(seed)
    folder = f"{path}.hf"
    model.save_pretrained(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    family = HUBS[hub]
    tok = family["tokenizer"]()
    tokens, types = llama_cpp_vocab(tok, cfg.vocab_size)
    arch = cfg.model_type
    keys = {f"{arch}.block_count": cfg.n_layer, f"{arch}.context_length": cfg.block_size,
            f"{arch}.embedding_length": cfg.n_embd, f"{arch}.feed_forward_length": cfg.n_inner,
            f"{arch}.attention.head_count": cfg.n_head, f"{arch}.attention.head_count_kv": cfg.n_kv_head,
            f"{arch}.rope.freq_base": cfg.rope_theta, f"{arch}.attention.layer_norm_rms_epsilon": cfg.norm_eps}
    if arch != "qwen2" or cfg.head_dim != cfg.n_embd // cfg.n_head:  # written where config.json has a head_dim
        keys[f"{arch}.attention.key_length"] = cfg.head_dim
    if arch == "llama":  # the converter's Llama writes vocab_size; its Qwen2 and Qwen3 do not
        keys[f"{arch}.vocab_size"] = cfg.vocab_size
    keys.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre or family["pre"],
                 "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                 **special_vocab(tok, family.get("config", {}), family["ids"]), **(metadata or {})})
    writer = gguf.GGUFWriter(path, keys.pop("general.architecture", arch))
    add_keys(writer, keys)
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


def add_keys(writer, keys):
    """Each metadata key in the GGUF type its Python value has (None: left out), as the converter
    writes them: lists as arrays, floats as float32, ints as uint32."""
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)


def write_tokenizer_gguf(path, tokens, scores, types, metadata, arch="gemma3"):
    """A GGUF holding a tokenizer and no tensors, as llama.cpp's converter lists a SentencePiece
    vocabulary (tokenizer.ggml.model 'llama'): every token with its score and type (BYTE for <0xNN>,
    CONTROL, USER_DEFINED, NORMAL), and `metadata` {key: value}: the bos/eos/unknown/padding ids,
    add_bos_token, ... (ints and bools)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", [float(s) for s in scores])
    writer.add_array("tokenizer.ggml.token_type", types)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Gemma 3 (llama.cpp's architecture 'gemma3', its converter's Gemma3Model), written from a Hugging Face checkpoint
# folder (config.json in either transformers layout, model.safetensors) rather than from a GPT of ours
GEMMA_VOCAB = os.path.join(FIXTURES, "tiny-gemma3", "gguf_vocab.json")  # a SentencePiece vocabulary cut from Gemma 3's
GEMMA3_NAMES = {**NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gemma3_gguf_name(hf_name):
    """'model.layers.3.pre_feedforward_layernorm.weight' -> 'blk.3.ffn_norm.weight': Gemma's four norms a layer are
    attn_norm, post_attention_norm, ffn_norm and post_ffw_norm (a Llama's post_attention_layernorm is ffn_norm)."""
    body, kind = hf_name.removeprefix("model.").rsplit(".", 1)
    if body.startswith("layers."):
        _, i, rest = body.split(".", 2)
        return f"blk.{i}.{GEMMA3_NAMES[rest]}.{kind}"
    return f"{GEMMA3_NAMES[body]}.{kind}"


def gemma3_hparams(config):
    """(global rope theta, linear rope scaling factor or None) from a Gemma 3 config.json in the transformers-5 layout
    (rope_parameters per layer type) or the transformers-4 one (rope_theta, rope_scaling)."""
    rope = (config.get("rope_parameters") or {}).get("full_attention")
    if rope is None:
        rope = dict(config.get("rope_scaling") or {}, rope_theta=config.get("rope_theta", 1_000_000.0))
    factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) == "linear" else None
    return float(rope.get("rope_theta", 1_000_000.0)), factor


def write_gemma3_gguf(path, folder, qtype="F32", vocab=GEMMA_VOCAB, drop=(), metadata=None, extra=None,
                      norm_shift=1.0, seed=0):
    """The Gemma 3 checkpoint in folder as a GGUF at path, as llama.cpp's converter (Gemma3Model) writes one: the
    keys gemma3.{context_length, embedding_length, block_count, feed_forward_length, attention.head_count,
    attention.layer_norm_rms_epsilon, attention.key_length, attention.value_length, rope.freq_base (the full-attention
    layers' theta), attention.sliding_window, attention.head_count_kv} and, for linear rope scaling,
    rope.scaling.type 'linear' and rope.scaling.factor; nothing for the layer pattern, the sliding layers' rope theta
    or query_pre_attn_scalar (llama.cpp assumes every 6th layer full, 10000, and 1/sqrt(key_length) except for
    62-layer models). The SentencePiece vocabulary `vocab` (a gguf_vocab.json: tokens, scores, types, metadata)
    with add_sep_token and add_space_prefix false; the embedding cut to the vocabulary's length (the converter drops
    the rows the tokenizer has no token for); every *norm.weight shifted by norm_shift (+1: the converter stores
    Gemma's 1 + w; 0 plants the mistake), in F32; the matrices in qtype; no output.weight (Gemma ties its head). drop,
    metadata (None removes a key) and extra as in write_gguf."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    voc = _load(vocab) if isinstance(vocab, str) else vocab
    theta, factor = gemma3_hparams(config)
    assert config.get("attn_logit_softcapping") is None  # the converter's own assertion
    head_dim = config.get("head_dim", 256)
    arch, rng = "gemma3", np.random.default_rng(seed)
    keys = {f"{arch}.context_length": config.get("max_position_embeddings", 131072),
            f"{arch}.embedding_length": config["hidden_size"], f"{arch}.block_count": config["num_hidden_layers"],
            f"{arch}.feed_forward_length": config["intermediate_size"],
            f"{arch}.attention.head_count": config.get("num_attention_heads", 8),
            f"{arch}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
            f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
            f"{arch}.rope.freq_base": theta}
    if config.get("final_logit_softcapping"):
        keys[f"{arch}.final_logit_softcapping"] = float(config["final_logit_softcapping"])
    keys[f"{arch}.attention.sliding_window"] = config["sliding_window"]
    keys[f"{arch}.attention.head_count_kv"] = config.get("num_key_value_heads", 4)
    if factor is not None:
        keys[f"{arch}.rope.scaling.type"] = "linear"
        keys[f"{arch}.rope.scaling.factor"] = float(factor)
    meta = voc["metadata"]
    keys.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                 "tokenizer.ggml.tokens": voc["tokens"], "tokenizer.ggml.scores": [float(s) for s in voc["scores"]],
                 "tokenizer.ggml.token_type": voc["types"],
                 **{k: meta[k] for k in meta if k.endswith("_token_id")},
                 "tokenizer.ggml.add_bos_token": meta.get("tokenizer.ggml.add_bos_token", True),
                 "tokenizer.ggml.add_sep_token": False,
                 "tokenizer.ggml.add_eos_token": meta.get("tokenizer.ggml.add_eos_token", False),
                 "tokenizer.ggml.add_space_prefix": False, **(metadata or {})})
    writer = gguf.GGUFWriter(path, arch)
    add_keys(writer, keys)
    for hf_name, t in tensors.items():
        if hf_name.startswith("lm_head."):  # the converter skips it
            continue
        name, w = gemma3_gguf_name(hf_name), t.float().numpy()
        if name in drop:
            continue
        if name == "token_embd.weight":
            w = w[:len(voc["tokens"])]
        if hf_name.endswith("norm.weight"):
            w = w + np.float32(norm_shift)
        kind = gguf.GGMLQuantizationType[qtype if w.ndim == 2 else "F32"]
        if kind.name in K_SCALES:
            writer.add_tensor(name, random_k_quant(w.shape, kind, rng), raw_dtype=kind)
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
