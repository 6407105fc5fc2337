"""
GGUF files (llama.cpp's format) in: one .gguf holds a model's architecture, its weights (often quantized) and its
tokenizer. They are read with the `gguf` package, llama.cpp's own Python reader (optional: pip install gguf), and
turned into what a Hugging Face directory would hold, so that hf.py and tokenizer.py do the rest with every check
they make there:

    read_model(path)      -> (config.json's dict, (HF tensor name, file, float32 tensor) triples)
    tokenizer(path)       -> (tokenizer.json's dict: vocab, merges, added tokens, the pre-tokenizer the file names;
                              the padding tokens {text: id})
    tokenizer_json(path)  -> the tokenizer.json alone
    eos_ids(path)         -> the ids that end a generation
    write_hf_tokenizer(path, folder): tokenizer.json, tokenizer_config.json and generation_config.json, so that the
                          checkpoints a run writes from a GGUF are whole Hugging Face model directories

The weights are dequantized to float32 by gguf itself. llama.cpp stores a Llama's q and k projections with each
head's rows reordered for its rotary kernel (pairs interleaved, where Hugging Face rotates the two halves of a head);
that is undone here. Qwen2 and Qwen3 are stored unreordered (llama.cpp rotates them as Hugging Face does).
"""
import functools
import json
import os

import numpy as np
import torch

from lib.errors import ConfigError, need_package

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# tokenizer.ggml.pre names the pre-tokenizer of the tokenizer.json the file was converted from; these are those
# tokenizer.json files' own (Qwen2's with its NFC normalizer)
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True)

def _split(regex):
    return dict(type="Sequence", pretokenizers=[
        dict(type="Split", pattern=dict(Regex=regex), behavior="Isolated", invert=False),
        dict(BYTE_LEVEL, trim_offsets=False, use_regex=False)])

PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> (normalizer, pre_tokenizer, ignore_merges: llama.cpp's for that pre, and
    # what Llama-3's tokenizer.json says: a word that is a vocab token is taken whole)
    "gpt-2": (None, BYTE_LEVEL, False),
    "smollm": (None, dict(type="Sequence", pretokenizers=[dict(type="Digits", individual_digits=True), BYTE_LEVEL]),
               False),
    "qwen2": (dict(type="NFC"), _split(QWEN2_REGEX), False),
    "llama-bpe": (None, _split(LLAMA3_REGEX), True),
}
# GGUF's tensor names -> Hugging Face's: outside the blocks, and inside block i ('blk.{i}.' -> 'model.layers.{i}.')
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
         "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
GEMMA3_BLOCK = dict(BLOCK, ffn_norm="pre_feedforward_layernorm", post_attention_norm="post_attention_layernorm",
                    post_ffw_norm="post_feedforward_layernorm")  # a norm after the attention and the MLP too
# tokenizer.ggml.token_type, as llama.cpp's converter writes it for a byte-level BPE: NORMAL the BPE vocab, CONTROL the
# special added tokens (and those that look it, <|...|>), USER_DEFINED the other added tokens, UNUSED the [PAD{id}]
# tokens that fill the ids up to the embedding's rows (Qwen2/2.5/3 have 151,936 rows for 151,665-151,669 tokens).
# UNKNOWN and BYTE (<0xNN>, the byte fallback) are SentencePiece's
TOKEN_TYPES = {1: "NORMAL", 2: "UNKNOWN", 3: "CONTROL", 4: "USER_DEFINED", 5: "UNUSED", 6: "BYTE"}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
VOCAB_TYPES = {"gpt2": (NORMAL, CONTROL, USER_DEFINED, UNUSED),
               "llama": (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE)}
GEMMAS = ("gemma", "gemma2", "gemma3")  # whose SentencePiece GGUF tokenizers are read
SPACE = "\u2581"  # SentencePiece's '▁', a space in its vocab

@functools.lru_cache(maxsize=1)  # the tokenizer, the eos ids and the model read one file: parse it once
def _reader(path):
    gguf = need_package('gguf', f"{path}: reading a GGUF file (llama.cpp's reader)")
    if not os.path.isfile(path):
        raise ConfigError(f"{path} not found: give the path of a .gguf file")
    try:
        return gguf, gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct and numpy errors on a damaged file
        raise ConfigError(f"{path} cannot be read as GGUF ({type(e).__name__}: {e}); the file is damaged or not "
                          f"GGUF: download it again") from None

def _metadata(path, key, default=None):
    field = _reader(path)[1].fields.get(key)
    return default if field is None else field.contents()

def _need(path, key):
    value = _metadata(path, key)
    if value is None:
        raise ConfigError(f"{path}: metadata {key!r} is missing; the GGUF is incomplete, convert the model again")
    return value

def _architecture(path):
    arch = _need(path, "general.architecture")
    if arch == "clip":
        raise ConfigError(f"{path} is a vision tower (llama.cpp's mmproj file); nanoGRPO trains the text model: "
                          f"give the model's own .gguf")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path}: architecture {arch!r} is not supported; nanoGRPO reads GGUF files of "
                          f"{', '.join(ARCHITECTURES)}")
    return arch

# -----------------------------------------------------------------------------
# the model

def _llama3_rope(path, freqs, theta, head_dim):
    """Llama-3.1's rope scaling as config.json says it, from the per-frequency divisors (rope_freqs) that llama.cpp
    stores instead: every Llama-3.x uses low_freq_factor 1, high_freq_factor 4 and an original context of 8192,
    and the largest divisor is the factor. Refused unless those give back the file's divisors."""
    rope = dict(rope_type="llama3", factor=float(freqs.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((8192 / wavelen - 1.0) / 3.0, 0, 1)
    divisor = 1 / ((1 - smooth) / rope["factor"] + smooth)
    if freqs.shape != divisor.shape or not np.allclose(freqs, divisor, rtol=1e-4):  # float32 in the file
        raise ConfigError(f"{path}: its rope_freqs are not Llama-3.1's rope scaling; only that one is supported")
    return rope

def _hf_name(name, arch):
    """The Hugging Face name of GGUF tensor name; one it does not know is left as it is (lib/hf.py then refuses it)."""
    part = name.split(".")
    if part[0] == "blk" and len(part) == 4:
        block = GEMMA3_BLOCK if arch == "gemma3" else BLOCK
        return f"model.layers.{part[1]}.{block.get(part[2], part[2])}.{part[3]}"
    return ".".join([TOP.get(part[0], part[0]), *part[1:]])

def _embedding_rows(path, tensors):
    """The vocabulary the weights have: token_embd's rows. The tokenizer may list fewer tokens (the embedding padded
    past it, as in a Hugging Face checkpoint), never more: those ids would have no row."""
    field = _reader(path)[1].fields.get("tokenizer.ggml.tokens")
    tokens = 0 if field is None else len(field.data)  # counted, not read: 151,936 strings take a while
    embd = tensors.get("token_embd.weight")
    if embd is None:
        return tokens or None  # lib/hf.py names the missing tensor
    rows = int(embd.shape[-1])  # gguf lists a tensor's dimensions innermost first: (columns, rows)
    if tokens > rows:
        raise ConfigError(f"{path}: the tokenizer has {tokens} tokens but token_embd.weight {rows} rows, so ids "
                          f"{rows}-{tokens - 1} have no weights; the file's tokenizer is another model's or the file "
                          f"is damaged: convert the model again")
    return rows

def read_model(path):
    """(the config.json this model would have, its tensors as (Hugging Face name, path, float32 tensor) one at a
    time). The config is hf.parse_config's to check and write_config's to write back."""
    gguf, reader = _reader(path)
    arch = _architecture(path)
    tensors = {t.name: t for t in reader.tensors}
    for t in tensors.values():
        if t.tensor_type.name not in QUANTS:
            raise ConfigError(f"{path}: tensor {t.name!r} is {t.tensor_type.name}, which is not supported; nanoGRPO "
                              f"dequantizes {', '.join(QUANTS)}: use a GGUF of one of those")
    def key(name, default=None):
        return _metadata(path, f"{arch}.{name}", default)
    heads = _need(path, f"{arch}.attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    hidden = _need(path, f"{arch}.embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    theta = float(key("rope.freq_base", 10000.0))
    if key("rope.scaling.type", "none") not in ("none", "linear") or (key("rope.scaling.factor", 1.0) != 1.0 and
                                                                      arch != "gemma3"):
        raise ConfigError(f"{path}: rope scaling {key('rope.scaling.type')!r} is not supported; nanoGRPO does "
                          f"Llama-3.1's (rope_freqs) and none")
    rows = _embedding_rows(path, tensors)  # Qwen's files name no vocab_size: the embedding says it
    freqs = tensors.get("rope_freqs.weight")  # Llama-3.1's scaling, as llama.cpp stores it
    rope = None if freqs is None else _llama3_rope(path, gguf.quants.dequantize(freqs.data, freqs.tensor_type), theta,
                                                    head_dim)
    config = dict(
        architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(arch, "Qwen3ForCausalLM")],
        model_type=arch, vocab_size=key("vocab_size") or rows,
        hidden_size=hidden, intermediate_size=_need(path, f"{arch}.feed_forward_length"),
        num_hidden_layers=_need(path, f"{arch}.block_count"), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=_need(path, f"{arch}.context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6), rope_theta=theta, rope_scaling=rope,
        tie_word_embeddings="output.weight" not in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_metadata(path, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_metadata(path, "tokenizer.ggml.eos_token_id"), torch_dtype="float32")

    def weights():
        for t in tensors.values():
            if t.name == "rope_freqs.weight":  # read into config's rope_scaling above
                continue
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # (rows, columns), as torch's
            if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
                n = heads if ".attn_q." in t.name else kv_heads
                # llama.cpp's rows of a head: the pairs (i, i + head_dim/2) side by side; back to the two halves
                w = w.reshape(n, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            if arch == "gemma3" and t.name.endswith("norm.weight"):
                w = w - np.float32(1)  # llama.cpp stores Gemma's norm weights as 1 + w, the scale itself
            yield _hf_name(t.name, arch), path, torch.from_numpy(np.ascontiguousarray(w))
    if arch == "gemma3":
        config.update(_gemma3_config(path, config, key))
    return config, weights()

def _gemma3_config(path, config, key):
    """Gemma 3's keys, of which a GGUF holds the window only: llama.cpp fixes the rest as here (a global layer
    every 6th, the sliding layers' RoPE base 10,000, scores scaled by head_dim ** -0.5, the 27B's by
    (hidden / heads) ** -0.5) unless the file says otherwise."""
    factor = key("rope.scaling.factor", 1.0)
    pattern, n = key("attention.sliding_window_pattern", 6), config["num_hidden_layers"]
    return dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", rope_scaling=None if factor == 1.0
                else dict(rope_type="linear", factor=float(factor)), sliding_window=_need(
                path, "gemma3.attention.sliding_window"), rope_local_base_freq=float(key("rope.freq_base_swa",
                10000.0)), layer_types=[("full" if (i + 1) % pattern == 0 else "sliding") + "_attention" for i in
                range(n)], query_pre_attn_scalar=config["hidden_size"] // config["num_attention_heads"] if n == 62
                else config["head_dim"], hidden_activation="gelu_pytorch_tanh")

# -----------------------------------------------------------------------------
# the tokenizer

def chat_template(path):
    """The chat template (Jinja text) the file carries, or None."""
    return _metadata(path, "tokenizer.chat_template")

def special_tokens(path):
    """{bos_token, eos_token, pad_token, unk_token: their strings} for the file's token ids that
    name them, as a chat template reads them."""
    tokens = _need(path, "tokenizer.ggml.tokens")
    ids = {name: _metadata(path, f"tokenizer.ggml.{key}_token_id")
           for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                             ("unk_token", "unknown"))}
    return {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}


def _vocab(path, model):
    """tokenizer.ggml.tokens and token_type, checked: one type for each token, and each type one
    that a vocabulary of tokenizer.ggml.model `model` has (VOCAB_TYPES)."""
    tokens, types = _need(path, "tokenizer.ggml.tokens"), _need(path, "tokenizer.ggml.token_type")
    if len(types) != len(tokens):
        raise ConfigError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                          f"{len(tokens)} tokens; the file is damaged: convert the model again")
    allowed = VOCAB_TYPES[model]
    bad = next((i for i, t in enumerate(types) if t not in allowed), None)
    if bad is not None:
        kind = TOKEN_TYPES.get(types[bad])
        what = (f"type {kind} ({types[bad]})" if kind else
                f"type {types[bad]}, none of llama.cpp's (1-6)")
        if model == "gpt2" and types[bad] in (UNKNOWN, BYTE):
            what += (", which llama.cpp's converter writes for SentencePiece vocabularies, not "
                     "byte-level BPE ones")
        names = ", ".join(TOKEN_TYPES[t] for t in allowed)
        raise ConfigError(f"{path}: token {tokens[bad]!r} (id {bad}) has token {what}; nanoGRPO "
                          f"reads {names} tokens in a {model!r} GGUF: convert the model again")
    return tokens, types

def _sentencepiece(path):
    """The tokenizer.json of a SentencePiece vocabulary (tokenizer.ggml.model 'llama') as
    transformers builds it from a Gemma GGUF: CONTROL (and UNKNOWN) tokens special added tokens,
    USER_DEFINED ones added tokens that are not special, BYTE tokens the byte fallback, each split
    of a token into two tokens a merge, ranked by the merged token's id (Gemma's scores do not
    follow its merge order; its ids do), the longer left part first."""
    arch = _need(path, "general.architecture")
    if arch not in GEMMAS:
        raise ConfigError(f"{path}: a SentencePiece tokenizer (tokenizer.ggml.model 'llama') in a "
                          f"{arch!r} GGUF; nanoGRPO reads those of {', '.join(GEMMAS)} only "
                          f"(Llama-2's layout differs): use the model's tokenizer.json instead")
    if _metadata(path, "tokenizer.ggml.add_space_prefix", False):
        raise ConfigError(f"{path}: tokenizer.ggml.add_space_prefix is true, which no Gemma "
                          f"tokenizer is; the file is another model's or damaged: convert it again")
    tokens, types = _vocab(path, "llama")
    # the converter writes Gemma's tokens of spaces with spaces; its tokenizer.json, with '▁'
    text = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(text)}
    if len(vocab) < len(text):
        raise ConfigError(f"{path}: tokenizer.ggml.tokens lists a token twice; the file is "
                          f"damaged: convert the model again")
    splits = ((t[:k], t[k:]) for t in text for k in range(1, len(t)))
    merges = sorted((m for m in splits if m[0] in vocab and m[1] in vocab),
                    key=lambda m: (vocab[m[0] + m[1]], -len(m[0])))
    added = [dict(id=i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False,
                  special=role != USER_DEFINED) for i, (t, role) in enumerate(zip(tokens, types))
             if role in (UNKNOWN, CONTROL) or (role == USER_DEFINED and t == text[i])]
    bos = _metadata(path, "tokenizer.ggml.bos_token_id")
    unk = _metadata(path, "tokenizer.ggml.unknown_token_id")
    post = None
    if bos is not None and _metadata(path, "tokenizer.ggml.add_bos_token", True):
        first = dict(SpecialToken=dict(id=tokens[bos], type_id=0))
        single = [first, dict(Sequence=dict(id="A", type_id=0))]
        specials = {tokens[bos]: dict(id=tokens[bos], ids=[bos], tokens=[tokens[bos]])}
        post = dict(type="TemplateProcessing", single=single, pair=single + single[1:],
                    special_tokens=specials)
    replace = dict(type="Replace", pattern=dict(String=SPACE), content=" ")
    model = dict(type="BPE", dropout=None, unk_token=None if unk is None else tokens[unk],
                 continuing_subword_prefix=None, end_of_word_suffix=None, fuse_unk=True,
                 byte_fallback=True, ignore_merges=False, vocab=vocab,
                 merges=[list(m) for m in merges])
    return dict(version="1.0", truncation=None, padding=None, added_tokens=added,
                normalizer=dict(type="Replace", pattern=dict(String=" "), content=SPACE),
                pre_tokenizer=dict(type="Split", pattern=dict(String=" "),
                                   behavior="MergedWithPrevious", invert=False),
                post_processor=post, model=model, decoder=dict(type="Sequence", decoders=[
                    replace, dict(type="ByteFallback"), dict(type="Fuse")]))

def tokenizer(path):
    """(the tokenizer.json that the GGUF's tokenizer metadata describes, in the layout of the hub's files; the
    padding tokens {text: id}). Of tokenizer.ggml.token_type: NORMAL tokens are the BPE vocab, CONTROL ones special
    added tokens, USER_DEFINED ones added tokens that are not special, and tokenizer.ggml.pre picks the normalizer
    and pre-tokenizer. UNUSED tokens are the converter's padding, [PAD{id}] up to the embedding's rows: the hub's
    tokenizer.json leaves those ids out, and transformers' GGUF tokenizer keeps them as BPE tokens that no merge
    makes, so never encoded, decoded as their text; so they come apart here, to be decoded and never encoded."""
    kind, pre = _need(path, "tokenizer.ggml.model"), _metadata(path, "tokenizer.ggml.pre", "default")
    if kind == "llama":
        return _sentencepiece(path), {}
    if kind != "gpt2":
        raise ConfigError(f"{path}: tokenizer.ggml.model {kind!r} is not a byte-level BPE "
                          f"('gpt2') nor SentencePiece ('llama'); nanoGRPO reads only those")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; nanoGRPO reproduces "
                          f"{', '.join(PRE_TOKENIZERS)}")
    tokens, types = _vocab(path, "gpt2")
    added = [dict(id=i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False,
                  special=role == CONTROL) for i, (t, role) in enumerate(zip(tokens, types))
             if role in (CONTROL, USER_DEFINED)]
    normalizer, pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    byte_level = dict(BYTE_LEVEL, add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok = dict(version="1.0", truncation=None, padding=None, added_tokens=added, normalizer=normalizer,
               pre_tokenizer=pre_tokenizer, post_processor=byte_level, decoder=byte_level,
               model=dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None,
                          end_of_word_suffix=None, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges,
                          vocab={t: i for i, (t, role) in enumerate(zip(tokens, types)) if role != UNUSED},
                          merges=_need(path, "tokenizer.ggml.merges")))
    return tok, {t: i for i, (t, role) in enumerate(zip(tokens, types)) if role == UNUSED}

def tokenizer_json(path):
    """The tokenizer.json of the GGUF's tokenizer (see tokenizer()), without the padding."""
    return tokenizer(path)[0]

def eos_ids(path):
    """The ids that end a generation: the file's end-of-sequence and end-of-turn tokens, sorted."""
    ids = {_metadata(path, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")} - {None}
    return sorted(ids) or None

def write_hf_tokenizer(path, folder):
    """The GGUF's tokenizer as Hugging Face files in folder: tokenizer.json, tokenizer_config.json (the chat
    template and the special tokens' names) and generation_config.json (the eos ids). Each written atomically."""
    tok = tokenizer_json(path)
    names = special_tokens(path)
    # the architecture unchecked: Gemma's tokenizer is read, though not its model yet
    arch = _need(path, "general.architecture")
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=names.get("bos_token"),
                  eos_token=names.get("eos_token"), pad_token=names.get("pad_token"),
                  unk_token=names.get("unk_token"),
                  add_bos_token=bool(_metadata(path, "tokenizer.ggml.add_bos_token", False)),
                  chat_template=_metadata(path, "tokenizer.chat_template"),
                  model_max_length=_need(path, f"{arch}.context_length"))
    generation = dict(bos_token_id=_metadata(path, "tokenizer.ggml.bos_token_id"), eos_token_id=eos_ids(path))
    os.makedirs(folder, exist_ok=True)
    for file, obj in (("tokenizer.json", tok), ("tokenizer_config.json", config),
                      ("generation_config.json", generation)):
        tmp = os.path.join(folder, f"{file}.tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=None if file == "tokenizer.json" else 2)
        os.replace(tmp, os.path.join(folder, file))
