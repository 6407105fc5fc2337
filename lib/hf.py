"""
Hugging Face checkpoints without transformers: config.json to GPTConfig and back, the weights' names, and shards.

    config.json                         the architecture; model_type picks the family (see read_config)
    model.safetensors                   the weights, or for a big model, instead:
    model.safetensors.index.json        {"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard}}
    model-00001-of-00003.safetensors    ... and the shards it names (one layer may sit in two of them)

GPT-2's tensors have our names (model.py follows GPT2LMHeadModel's), its Conv1D matrices stored (in, out), the
transpose of ours. The Llama family (Llama, Qwen2, Qwen3, Mistral) names every projection on its own; model.py fuses
q, k and v into c_attn and the gate and up projections into c_fc (one matmul each), so loading copies each stored
tensor into its rows of ours and saving cuts them out again: bit-exact both ways, so a trained policy loads in
transformers, vLLM or llama.cpp's converter unchanged. Nothing is ever unpickled.
"""
import json
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from lib.errors import ConfigError

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}  # model_type -> architecture
GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
LLAMA_NAMES = [("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
               ("transformer.h.", "model.layers."), (".ln_1.", ".input_layernorm."),
               (".ln_2.", ".post_attention_layernorm."), (".attn.c_proj.", ".self_attn.o_proj."),
               (".attn.", ".self_attn."), (".mlp.c_proj.", ".mlp.down_proj.")]  # ours -> theirs, in this order
GEMMA3_NAMES = [(".ln_2.", ".pre_feedforward_layernorm."), (".post_attn_norm.", ".post_attention_layernorm."),
                (".post_mlp_norm.", ".post_feedforward_layernorm.")] + LLAMA_NAMES  # its post_attention_ is after
MULTIMODAL_TEXT = ("model.language_model.", "language_model.model.")  # a multimodal Gemma 3's text model (5, 4)
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# -----------------------------------------------------------------------------
# config.json

def read_json(file, missing, fix):
    """The JSON object in file; FileNotFoundError `missing` if there is none, ValueError `fix` if it is not JSON."""
    if not os.path.isfile(file):
        raise ConfigError(f"{file} not found: {missing}")
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e}); {fix}") from None

def read_config(path):
    """(GPTConfig fields, the checkpoint's dtype) from path/config.json, either transformers' 4 or 5 layout."""
    file = os.path.join(path, "config.json")
    return parse_config(read_json(file, "from_pretrained needs a Hugging Face model directory with config.json and "
                                        "model.safetensors (or model.safetensors.index.json and its shards), or a "
                                        ".gguf file", "restore it from the model's original files"), file)

def parse_config(hf, file):
    """read_config's result for the config.json dict hf (read from file, or what gguf_file makes of a GGUF)."""
    kind = hf.get("model_type")
    if kind == "gemma3" and isinstance(hf.get("text_config"), dict):  # Gemma3ForConditionalGeneration
        print(f"{file}: a multimodal Gemma 3: reading its text model only (its vision tower is not read)")
        hf = dict(hf["text_config"], model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                  tie_word_embeddings=True, **{k: hf[k] for k in ("dtype", "torch_dtype") if k in hf})
        kind = "gemma3_text"
    if kind == "gpt2":
        fields = _gpt2_config(hf, file)
    elif kind == "gemma3_text":
        fields = _gemma3_config(hf, file)
    elif kind in FAMILIES:
        fields = _llama_config(hf, file)
    else:
        raise ConfigError(f"{file}: model_type {kind!r} is not supported; nanoGRPO reads 'gpt2', "
                          f"{', '.join(map(repr, FAMILIES))}")
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"  # transformers 5 renamed torch_dtype
    if name not in DTYPES:
        raise ConfigError(f"{file}: dtype {name!r} is not one of {', '.join(DTYPES)}; set dtype (or torch_dtype) to "
                          f"the weights' own")
    return dict(fields, hf_config=hf), DTYPES[name]

def _need(hf, file, *keys):
    for k in keys:
        if hf.get(k) is None:
            raise ConfigError(f"{file}: missing key {k!r}; use the config.json that came with the weights")

def _gpt2_config(hf, file):
    hf = dict(hf, n_positions=hf.get("n_positions") or hf.get("n_ctx"))  # the oldest configs name it n_ctx only
    _need(hf, file, "n_positions", "vocab_size", "n_layer", "n_head", "n_embd")
    # settings that would change the maths model.py does
    if (hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh")
            or hf.get("layer_norm_epsilon", 1e-5) != 1e-5 or hf.get("n_inner") not in (None, 4 * hf["n_embd"])
            or hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("tie_word_embeddings", True)):
        raise ConfigError(f"{file}: unsupported GPT-2 variant (needs activation gelu_new, "
                          f"layer_norm_epsilon 1e-5, n_inner 4*n_embd, tied embeddings, unscaled attention)")
    return dict(block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                n_head=hf["n_head"], n_embd=hf["n_embd"], bias=True)

def _llama_config(hf, file):
    _need(hf, file, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "max_position_embeddings")
    kind, heads = hf["model_type"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    # rotary: transformers 4 has rope_theta on top and rope_scaling (null, or a dict with 'rope_type' or the older
    # 'type'); transformers 5 has both in rope_parameters
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"{file}: rope type {rope_type!r} is not supported; nanoGRPO does 'default' and 'llama3'")
    if rope_type == "llama3" and any(rope.get(k) is None for k in LLAMA3_ROPE):
        raise ConfigError(f"{file}: llama3 rope scaling needs {', '.join(LLAMA3_ROPE)}")
    window = hf.get("sliding_window")  # Qwen2/3 carry one with use_sliding_window false; Mistral's is on if set
    windowed = hf.get("use_sliding_window", kind == "mistral") and window is not None and \
        window < hf["max_position_embeddings"]
    if windowed or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise ConfigError(f"{file}: sliding-window attention is on (sliding_window={window}), and nanoGRPO only "
                          f"attends to the full context; use a checkpoint with full attention in every layer")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias") or heads % kv_heads:
        raise ConfigError(f"{file}: unsupported {kind} variant (needs hidden_act silu, no mlp_bias, "
                          f"num_attention_heads a multiple of num_key_value_heads)")
    return dict(model_type=kind, block_size=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                n_layer=hf["num_hidden_layers"], n_head=heads, n_embd=hf["hidden_size"], n_kv_head=kv_heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, n_inner=hf["intermediate_size"],
                norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", hf.get("rope_theta",
                10000.0))), rope_scaling={k: rope[k] for k in LLAMA3_ROPE} if rope_type == "llama3" else None,
                bias=kind != "qwen2" and bool(hf.get("attention_bias")), qkv_bias=kind == "qwen2",
                qk_norm=kind == "qwen3", tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))

def _gemma3_config(hf, file):
    """Gemma 3's fields, with transformers' defaults for the keys a config may leave out."""
    for key, supported in (("attn_logit_softcapping", None), ("final_logit_softcapping", None),
                           ("hidden_activation", "gelu_pytorch_tanh"), ("use_bidirectional_attention", False)):
        if hf.get(key) not in (None, supported):
            raise ConfigError(f"{file}: {key}={hf[key]!r} is not implemented by model.py's Gemma 3 block, "
                              f"which computes {key}={supported!r} only; use a Gemma 3 checkpoint whose "
                              f"config.json says so")
    rope = hf.get("rope_parameters") or {}  # transformers 5: one dict per kind of layer; 4: keys on top
    full = rope.get("full_attention") or dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 1e6))
    local = rope.get("sliding_attention") or dict(rope_theta=hf.get("rope_local_base_freq", 10000.0))
    kinds = (full.get("rope_type", full.get("type", "default")), local.get("rope_type", "default"))
    if kinds[0] not in ("default", "linear") or kinds[1] != "default":
        raise ConfigError(f"{file}: rope types {kinds} (global, sliding) are not supported; nanoGRPO's Gemma 3 "
                          f"does 'default' or 'linear' on the global layers and 'default' on the sliding ones")
    n, pattern = hf.get("num_hidden_layers"), hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    types = hf.get("layer_types") or [("full" if (i + 1) % pattern == 0 else "sliding") + "_attention"
                                       for i in range(n or 0)]
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{file}: layer_types must give each of the {n} layers 'full_attention' or "
                          f"'sliding_attention'; use the config.json that came with the weights")
    # the fields Gemma 3 shares with the Llama family, read as Qwen3's (q/k norms, no q/k/v biases)
    fields = _llama_config(dict(hf, hidden_act="silu", layer_types=None, sliding_window=None, rope_scaling=None,
                                rope_parameters=dict(rope_theta=full["rope_theta"]), model_type="qwen3"), file)
    return dict(fields, model_type="gemma3_text", layer_types=tuple(types), sliding_window=hf.get("sliding_window",
                4096), rope_local_theta=float(local["rope_theta"]), query_pre_attn_scalar=hf.get(
                "query_pre_attn_scalar", 256), tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                rope_scaling=dict(rope_type="linear", factor=float(full["factor"])) if kinds[0] == "linear" else None)

def write_config(path, cfg, dtype):
    """path/config.json for GPTConfig cfg: the keys of the config.json it was read from (if any) that it does not set
    (token ids, initializer range...) are written back unchanged, in the same layout (rope_parameters or rope_theta)."""
    dtype = str(dtype).removeprefix("torch.")
    old = dict(cfg.hf_config or {})
    if cfg.model_type == "gpt2":
        ours = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], activation_function="gelu_new",
                    n_positions=cfg.block_size, n_ctx=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                    n_head=cfg.n_head, n_inner=None, vocab_size=cfg.vocab_size, layer_norm_epsilon=1e-5,
                    tie_word_embeddings=True, initializer_range=0.02, attn_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                    resid_pdrop=cfg.dropout, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                    reorder_and_upcast_attn=False, use_cache=True)
    elif cfg.model_type == "gemma3_text":
        ours = _gemma3_keys(cfg, old)
    else:
        ours = dict(model_type=cfg.model_type, architectures=[FAMILIES[cfg.model_type]], hidden_act="silu",
                    vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_inner,
                    num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                    head_dim=cfg.head_dim, max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                    tie_word_embeddings=cfg.tie_word_embeddings)
        if cfg.model_type != "qwen2":  # Qwen2's q/k/v biases are part of the architecture, not a setting
            ours["attention_bias"] = cfg.bias
        scaling = dict(rope_type="llama3", **cfg.rope_scaling) if cfg.rope_scaling else None
        if "rope_parameters" in old:  # transformers 5
            ours["rope_parameters"] = dict(scaling or dict(rope_type="default"), rope_theta=cfg.rope_theta)
        else:  # transformers 4, which transformers 5, vLLM and llama.cpp's converter read too
            ours.update(rope_theta=cfg.rope_theta, rope_scaling=scaling)
    ours["dtype" if "dtype" in old else "torch_dtype"] = dtype
    _atomic_write(os.path.join(path, "config.json"), (json.dumps({**old, **ours}, indent=2) + "\n").encode())

def _gemma3_keys(cfg, old):
    """write_config's keys for Gemma 3, in the layout the checkpoint had (transformers 5's or 4's)."""
    full = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    ours = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
                vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_inner,
                num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                head_dim=cfg.head_dim, max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.bias,
                layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
                query_pre_attn_scalar=cfg.query_pre_attn_scalar)
    if "rope_parameters" in old:
        ours["rope_parameters"] = dict(full_attention=full, sliding_attention=dict(rope_type="default",
                                                                                rope_theta=cfg.rope_local_theta))
    else:
        ours.update(rope_theta=cfg.rope_theta, rope_local_base_freq=cfg.rope_local_theta,
                    rope_scaling=cfg.rope_scaling and dict(cfg.rope_scaling))
    return ours

# -----------------------------------------------------------------------------
# weights

def layout(cfg, shapes):
    """Where each stored tensor lives in our state dict: {HF name: (our name, first row, rows, transposed)},
    for a model of config cfg whose state dict has shapes {our name: shape}."""
    out = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the token embedding is the output layer; HF re-ties it
        if cfg.model_type == "gpt2":
            out[name] = (name, 0, shape[0], name.endswith(GPT2_TRANSPOSED))
            continue
        key = name
        for ours, theirs in GEMMA3_NAMES if cfg.model_type == "gemma3_text" else LLAMA_NAMES:
            key = key.replace(ours, theirs)
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        parts = ([("q_proj", q), ("k_proj", kv), ("v_proj", kv)] if ".c_attn." in name else
                 [("gate_proj", cfg.n_inner), ("up_proj", cfg.n_inner)] if ".c_fc." in name else [(None, shape[0])])
        row = 0
        for part, rows in parts:
            out[key.replace("c_attn", part).replace("c_fc", part) if part else key] = (name, row, rows, False)
            row += rows
    return out

def _files(path):
    """(the weight files, the index or None, its weight map or None) of the checkpoint at path."""
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):  # as transformers: a single file wins over an index
        return [single], None, None
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); restore it "
                              f"from the model's original files") from None
        files = [os.path.join(path, shard) for shard in sorted(set(weight_map.values()))]
        for file in files:
            if not os.path.isfile(file):
                raise ConfigError(f"{index} names the shard {os.path.basename(file)}, but {file} is missing; "
                                  f"download the checkpoint's files again")
        return files, index, weight_map
    raise ConfigError(f"{single} not found (nor {os.path.basename(index)}): from_pretrained needs a Hugging "
                      f"Face model directory with config.json and its safetensors weights")

def _tensors(files, index, weight_map):
    """Yield (name, file, tensor) for every tensor of the checkpoint, one at a time (a shard is never loaded
    whole), checking the shards against the index that names them."""
    for file in files:
        shard = os.path.basename(file)
        try:
            with safe_open(file, "pt") as f:
                names = list(f.keys())
                for name in names:
                    if weight_map is not None and weight_map.get(name) != shard:
                        raise ConfigError(f"{file}: holds tensor {name!r}, but {index} maps it to "
                                          f"{weight_map.get(name)!r}: the index and the shards disagree; download "
                                          f"the checkpoint's files again")
                    yield name, file, f.get_tensor(name)
        except SafetensorError as e:  # truncated, or not a safetensors file at all
            raise ConfigError(f"{file} cannot be read ({e}); the file is damaged or not safetensors: "
                              f"restore it or save the model again") from None
        for name in [n for n, s in (weight_map or {}).items() if s == shard and n not in names]:
            raise ConfigError(f"{index} maps tensor {name!r} to {shard}, which does not hold it: the index and the "
                              f"shards disagree; download the checkpoint's files again")

def read_tensors(path):
    """Every tensor of the checkpoint at path as (name, file, tensor), one at a time."""
    return _tensors(*_files(path))

def load_weights(path, cfg, ours, tensors=None):
    """Copy the checkpoint at path into ours, a state dict of a model of config cfg (its tensors share the
    parameters' storage), checking that each tensor is there, once, with the shape the config implies. tensors:
    (HF name, file, tensor) triples read from another format (gguf_file.read_model), instead of path's safetensors."""
    where = layout(cfg, {name: t.shape for name, t in ours.items()})
    source = path
    if tensors is None:
        files, index, weight_map = _files(path)
        tensors, source = _tensors(files, index, weight_map), index or files[0]
    loaded, heads = set(), []
    for key, file, t in tensors:
        name = key
        if cfg.model_type == "gpt2" and not key.startswith(("transformer.", "lm_head.")):
            name = "transformer." + key  # the original openai-community/gpt2 files have no prefix
        if name.endswith((".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")):
            continue  # buffers that old GPT-2 (causal mask) and Llama (rotary) files carry: model.py makes its own
        if cfg.model_type == "gemma3_text" and name.startswith(MULTIMODAL_TEXT):
            name = "model." + name.split(".", 2)[2]
        elif cfg.model_type == "gemma3_text" and ("vision_tower." in name or "multi_modal_projector." in name):
            continue  # a multimodal Gemma 3's image encoder, which the text model never reads
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            heads.append((file, t))  # a tied output layer stored anyway: checked against the embedding below
            continue
        if name not in where:
            raise ConfigError(f"{file}: unexpected tensor {key!r}, not part of a {cfg.model_type} of its config.json; "
                              f"use the config.json that came with these weights")
        ours_name, row, rows, transposed = where[name]
        dest = ours[ours_name].narrow(0, row, rows)
        expected = dest.t().shape if transposed else dest.shape
        if t.shape != expected:
            raise ConfigError(f"{file}: tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(expected)} "
                              f"from config.json; the config and the weights are of different models")
        dest.copy_(t.t() if transposed else t)
        loaded.add(name)
    missing = sorted(set(where) - loaded)
    if missing:
        raise ConfigError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all); the "
                          f"checkpoint is incomplete: download or save it again")
    for file, head in heads:
        if not torch.equal(head.to(ours["lm_head.weight"].dtype), ours["lm_head.weight"]):
            raise ConfigError(f"{file}: lm_head.weight differs from the token embedding, but config.json ties them "
                              f"(tie_word_embeddings); fix one of the two")

def save_weights(path, cfg, state_dict, max_shard_size):
    """Write the weights in the HF layout: model.safetensors, or, above max_shard_size bytes, shards and their index
    (files of the other layout left from an earlier save are removed, so the directory holds one checkpoint)."""
    shapes = {name: t.shape for name, t in state_dict.items()}
    tensors = {}
    for key, (name, row, rows, transposed) in layout(cfg, shapes).items():
        t = state_dict[name].detach().narrow(0, row, rows)
        tensors[key] = (t.t() if transposed else t).contiguous().cpu()
        if cfg.model_type == "gpt2" and not cfg.bias and name not in ("transformer.wte.weight",
                                                                      "transformer.wpe.weight"):
            # HF GPT-2 always has biases: a bias-free model is saved with zeros, the same function
            tensors[key.removesuffix("weight") + "bias"] = torch.zeros(shapes[name][0], dtype=t.dtype)
    shards, size = [{}], 0
    for key, t in tensors.items():  # in model order, so consecutive layers share a shard
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _atomic_write(os.path.join(path, name), save(shard, metadata={"format": "pt"}))
    index = os.path.join(path, "model.safetensors.index.json")
    if len(shards) > 1:  # the index last: it makes the new shards the checkpoint
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
        _atomic_write(index, (json.dumps(dict(metadata=dict(total_size=total), weight_map=weight_map), indent=2)
                              + "\n").encode())
    keep = set(names) | ({os.path.basename(index)} if len(shards) > 1 else set())
    for old in os.listdir(path):
        if old.startswith("model") and old.endswith((".safetensors", ".index.json")) and old not in keep:
            os.remove(os.path.join(path, old))

def _atomic_write(file, data):
    # a crash mid-save leaves the old file or the new one, never half of one
    tmp = f"{file}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
