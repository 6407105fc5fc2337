"""
LoRA (Hu et al. 2021, arXiv:2106.09685): the base weights W stay frozen and each targeted linear learns a low-rank
update, y = W x + b + (alpha / r) * B A dropout(x), with A (r, in) and B (out, r). B starts at zero, so training
starts from the base model exactly, and only the adapters (a few MB) train and are saved.

Names and files are PEFT's, so an adapter trained here loads in PEFT, vLLM or transformers on the same base:

    adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules, ...
    adapter_model.safetensors   base_model.model.<HF module>.lora_A.weight (r, in), ...lora_B.weight (out, r)

target_modules are the Hugging Face module names of the family, matched as PEFT does (a target matches a module
whose path ends with it): q_proj k_proj v_proj o_proj gate_proj up_proj down_proj for the Llama family, c_attn c_proj
c_fc for GPT-2 ('c_proj' is both the attention's and the MLP's, 'attn.c_proj' the attention's only), or 'all-linear'
(every linear of the blocks, never the output layer). model.py fuses q, k, v into c_attn and gate, up into c_fc; each
targeted part of a fused linear gets its own A and B (as in PEFT) and adds only into its own rows.

How train.py uses it: add_lora(model, ...) after loading (and any warm start), AdamW over the parameters that
require grad (the adapters), the reference policy is the same model under adapters_off(model) (no second copy of the
weights), generation under merged(model) or not (see merged), and save_adapter / load_adapter beside the checkpoint.
The adapters are plain registered Parameters (no hooks), so DDP, FSDP's fully_shard (add_lora and load_adapter
before sharding) and torch.compile see an ordinary model.
"""
import json
import math
import os
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.nn import functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from lib import hf, parallelism
from lib.errors import ConfigError

# the reference policy of a LoRA run is the base (adapters off): no second copy of the model
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's wrapper (PeftModel.base_model.model) in front of the HF module path


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus low-rank adapters on some of its row ranges (parts). It holds the linear's own weight
    and bias Parameters, so the base state-dict keys and lib/hf.py's load and save are unchanged. All parts' A are one
    parameter (parts * r, in): one matmul for every part, then each part's B into its rows."""

    def __init__(self, base, parts, rank, alpha, dropout):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias  # the same Parameter objects, frozen by add_lora
        self.out_features, self.in_features = base.weight.shape
        self.parts = parts  # [(HF module path, first row, rows)] of the targeted parts, in row order
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(len(parts) * rank, self.in_features, **kw))  # (parts * r, in)
        # PEFT's init: A as nn.Linear's default (fan_in is `in` for the stacked A as for each part's), B zeros
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.ParameterList([nn.Parameter(torch.zeros(rows, rank, **kw)) for _, _, rows in parts])
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()  # on the adapter's input only
        self.active = True  # False: the base linear alone (adapters_off, or merged into the weight)
        self.merged = False

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        if not self.active:
            return y
        z = F.linear(self.lora_dropout(x), self.lora_A) * self.scale  # (..., parts * r) A x of every part at once
        if len(self.parts) == 1 and self.parts[0][2] == self.out_features:  # one part, all the rows
            return y + F.linear(z, self.lora_B[0])  # (..., out)
        # out of place (autograd refuses an in-place add into y when y needs no grad), the untargeted rows as is
        pieces, row = [], 0
        for (_, first, rows), B, zi in zip(self.parts, self.lora_B, z.split(self.rank, dim=-1)):
            pieces += [y[..., row:first], y[..., first:first + rows] + F.linear(zi, B)]  # (..., rows) + B_p (A_p x)
            row = first + rows
        return torch.cat(pieces + [y[..., row:]], dim=-1)  # (..., out)

    def delta(self):
        """[(first row, rows, scale * B A (rows, in))] of each part, in at least float32: what merging adds."""
        dt = torch.promote_types(self.weight.dtype, torch.float32)
        return [(first, rows, self.scale * (B.to(dt) @ A.to(dt))) for (_, first, rows), B, A
                in zip(self.parts, self.lora_B, self.lora_A.split(self.rank))]

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, r={self.rank}, alpha={self.alpha}, "
                f"parts={[p[0].rsplit('.', 1)[-1] for p in self.parts]}")


def _linears(model):
    """{our module name: [(HF module path, first row, rows)]} of every linear in the blocks, from hf.layout (the one
    place the two naming schemes meet); a fused linear has one entry per HF module."""
    cfg = model.config
    shapes = {f"{name}.weight": m.weight.shape for name, m in model.named_modules()
              if name.startswith("transformer.h.") and isinstance(m, (nn.Linear, LoRALinear))}
    out = {}
    for key, (name, first, rows, _) in hf.layout(cfg, shapes).items():
        out.setdefault(name.removesuffix(".weight"), []).append((key.removesuffix(".weight"), first, rows))
    return out


def _leaf_names(linears):
    """The HF module names of the family, in model order: what target_modules can name."""
    return list(dict.fromkeys(path.rsplit(".", 1)[-1] for parts in linears.values() for path, _, _ in parts))


def _resolve(model, targets, what):
    """(target_modules as saved, the set of targeted HF module paths); PEFT's matching: a target names a module
    whose path is it or ends with '.' + it. A target that matches nothing is a ValueError."""
    linears = _linears(model)
    names = _leaf_names(linears)
    paths = [path for parts in linears.values() for path, _, _ in parts]
    if targets == "all-linear":
        return names, set(paths)  # PEFT saves 'all-linear' as the names it expands to
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{what}: target_modules must be 'all-linear' or a non-empty list of module names, got "
                          f"{targets!r}; valid names for {model.config.model_type}: {', '.join(names)}")
    chosen = set()
    for t in targets:
        hit = {p for p in paths if p == t or p.endswith("." + t)}
        if not hit:
            raise ConfigError(f"{what}: LoRA target {t!r} matches no linear layer of this {model.config.model_type} "
                              f"model; use some of {', '.join(names)} (or 'all-linear')")
        chosen |= hit
    return sorted(set(targets)), chosen


def lora_modules(model):
    """The LoRALinear modules of model (through any wrapper: DDP, torch.compile)."""
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def has_adapters(model):
    """True once add_lora has been applied."""
    return bool(lora_modules(model))


def lora_parameters(model):
    """The adapter parameters, the only ones add_lora leaves trainable."""
    return [p for m in lora_modules(model) for p in (m.lora_A, *m.lora_B)]


def add_lora(model, rank, alpha, dropout=0.0, targets="all-linear"):
    """In place: wrap every targeted linear of model's blocks in a LoRALinear (rank r, scale alpha / r, dropout on
    the adapters' input in training mode) and freeze every base parameter, so only the adapters train. Returns model.
    targets: PEFT's target_modules in the family's HF names, or 'all-linear'."""
    if has_adapters(model):
        raise ValueError("add_lora: the model already has LoRA adapters; add them once, to the base model")
    if not (isinstance(rank, int) and rank >= 1 and alpha > 0 and 0 <= dropout < 1):
        raise ValueError(f"add_lora needs an integer rank >= 1, alpha > 0 and 0 <= dropout < 1, got rank={rank!r} "
                         f"alpha={alpha!r} dropout={dropout!r}")
    saved, chosen = _resolve(model, targets, "add_lora")
    model.requires_grad_(False)
    for name, parts in _linears(model).items():
        parts = [p for p in parts if p[0] in chosen]
        if parts:
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, leaf, LoRALinear(getattr(owner, leaf), parts, rank, alpha, dropout))
    model.lora_config = dict(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=saved)
    return model


@contextmanager
def _active(model, on):
    mods = lora_modules(model)
    if any(m.merged for m in mods):
        raise RuntimeError("the adapters are merged into the weights; leave merged() first")
    before = [m.active for m in mods]
    for m in mods:
        m.active = on
    try:
        yield model
    finally:
        for m, b in zip(mods, before):
            m.active = b


def adapters_off(model):
    """Context manager: inside it the model computes the base model alone, the frozen reference policy of GRPO's KL
    term without a second copy of the weights. (A torch.compile'd forward compiles once more for this mode.)"""
    return _active(model, False)


@contextmanager
def merged(model):
    """Context manager: W += (alpha / r) B A in place for fast generation (no adapter matmuls), the adapter path
    switched off so nothing counts twice; on exit the targeted rows are copied back from copies taken on entry, so
    the base weights are bitwise what they were (subtracting would round). Not for training inside it. Under FSDP
    only inside parallelism.gathered(model), which holds the whole weights. In low precision (bf16 weights, or FSDP's
    bf16 compute copies) the merged weight is rounded to its dtype, which can lose much of a small update."""
    mods = lora_modules(model)
    if any(m.merged or not m.active for m in mods):
        raise RuntimeError("merged() inside merged() or adapters_off(): merge from the plain adapted model")
    if any(parallelism.is_dtensor(m.weight) for m in mods):
        raise RuntimeError("merged() on sharded weights: under FSDP call it inside parallelism.gathered(model)")
    saved = []
    try:
        with torch.no_grad():
            for m in mods:
                m.merged, m.active = True, False
                for first, rows, delta in m.delta():  # delta (rows, in)
                    w = m.weight.narrow(0, first, rows)  # (rows, in) a view of the weight
                    saved.append((w, w.clone()))
                    w.copy_(w.to(delta.dtype) + delta)  # summed in at least float32, rounded once into w's dtype
        yield model
    finally:
        with torch.no_grad():
            for w, copy in saved:
                w.copy_(copy)
        for m in mods:
            m.merged, m.active = False, True


def merged_state_dict(model, state_dict):
    """The merged model's weights: state_dict (the base's whole tensors, e.g. parallelism.full_state_dict's; {} on
    the ranks that keep nothing) with each adapter's scale * B A added into its rows, on copies of the adapted
    weights. Every rank calls it under FSDP: the adapters are gathered."""
    out = dict(state_dict)
    for name, m in model.named_modules():
        if not isinstance(m, LoRALinear):
            continue
        A = parallelism.full(m.lora_A.detach())  # (parts * r, in)
        for (_, first, rows), B, a in zip(m.parts, m.lora_B, A.split(m.rank)):
            B = parallelism.full(B.detach())  # (rows, r)
            if out:
                w = out[f"{name}.weight"] = out[f"{name}.weight"].clone()  # never the live parameter
                w[first:first + rows] += (m.scale * (B.double() @ a.double())).to(w.device, w.dtype)
    return out


# -----------------------------------------------------------------------------
# PEFT files

def _tensors(model, get=lambda t: t):
    """{PEFT key: get(tensor)} of model's adapters: each part's A (r, in) and B (rows, r); get(the stacked A) is
    split into the parts' A, views of it (load_adapter copies into them)."""
    out = {}
    for m in lora_modules(model):
        for (path, _, _), B, A in zip(m.parts, m.lora_B, get(m.lora_A).split(m.rank)):
            out[f"{PREFIX}{path}.lora_A.weight"] = A  # (r, in)
            out[f"{PREFIX}{path}.lora_B.weight"] = get(B)  # (rows, r)
    return out


def _adapted(model):
    """The GPT inside model (itself, or under a DDP / torch.compile wrapper) that add_lora adapted."""
    gpt = next((m for m in model.modules() if hasattr(m, "lora_config")), None)
    if gpt is None:
        raise ValueError("the model has no LoRA adapters; call lora.add_lora(model, ...) first")
    return gpt


def save_adapter(model, path, base_model_name_or_path=None, write=True):
    """Write path/adapter_model.safetensors and path/adapter_config.json (PEFT's layout), each atomically; the
    config last, so a directory with a config has the tensors that go with it. Under FSDP every rank calls it (the
    adapters are gathered, a collective) and only the one with write=True writes."""
    gpt = _adapted(model)
    tensors = {k: t.contiguous() for k, t in _tensors(model, lambda t: parallelism.full(t.detach()).cpu()).items()}
    if not write:
        return
    os.makedirs(path, exist_ok=True)
    hf._atomic_write(os.path.join(path, WEIGHTS), save(tensors, metadata={"format": "pt"}))
    config = dict(
        peft_type="LORA", task_type="CAUSAL_LM", **gpt.lora_config, bias="none",
        fan_in_fan_out=gpt.config.model_type == "gpt2",  # GPT-2's HF modules are Conv1D, weights stored (in, out)
        base_model_name_or_path=base_model_name_or_path, inference_mode=True, use_rslora=False,
        init_lora_weights=True, modules_to_save=None, rank_pattern={}, alpha_pattern={})
    hf._atomic_write(os.path.join(path, CONFIG), (json.dumps(config, indent=2) + "\n").encode())


def load_adapter(model, path):
    """Load path's PEFT adapter (adapter_config.json + adapter_model.safetensors) into model, which add_lora has
    given the same r, lora_alpha and targets; every tensor must be there with its shape, or nothing is loaded.
    Nothing is unpickled. Under FSDP, load before sharding (parallelism.shard), as the base weights."""
    gpt = _adapted(model)
    lora = gpt.lora_config
    file = os.path.join(path, CONFIG)
    theirs = hf.read_json(file, f"load_adapter needs a PEFT adapter directory ({CONFIG} and {WEIGHTS}), as "
                                f"save_adapter writes", "restore it or save the adapter again")
    if theirs.get("peft_type") != "LORA" or theirs.get("use_rslora") or theirs.get("rank_pattern") \
            or theirs.get("alpha_pattern"):
        raise ConfigError(f"{file}: needs a plain LoRA adapter (peft_type LORA, no use_rslora, rank_pattern or "
                          f"alpha_pattern), got peft_type {theirs.get('peft_type')!r}; use another adapter")
    for key, arg in (("r", "rank"), ("lora_alpha", "alpha")):
        if theirs.get(key) != lora[key]:
            raise ConfigError(f"{file}: {key} is {theirs.get(key)!r} but the model's adapters have {lora[key]!r}; "
                              f"call add_lora with {arg}={theirs.get(key)!r} before loading this adapter")
    _, ours = _resolve(gpt, lora["target_modules"], file)
    if _resolve(gpt, theirs.get("target_modules"), file)[1] != ours:
        raise ConfigError(f"{file}: target_modules {theirs.get('target_modules')!r} adapt other layers than the "
                          f"model's {lora['target_modules']!r}; call add_lora with the adapter's target_modules")
    want = _tensors(model)
    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        raise ConfigError(f"{file} not found: the adapter is incomplete; save it again")
    try:
        with safe_open(file, "pt") as f:
            loaded = {key: f.get_tensor(key) for key in f.keys()}  # adapters are small: all checked before any copy
    except SafetensorError as e:
        raise ConfigError(f"{file} cannot be read ({e}); the file is damaged: restore it or save the adapter "
                          f"again") from None
    extra, missing = sorted(set(loaded) - set(want)), sorted(set(want) - set(loaded))
    if extra:  # a bias, modules_to_save or another layer's adapter: it would be silently dropped
        raise ConfigError(f"{file}: unexpected tensor {extra[0]!r} ({len(extra)} in all), not a LoRA weight of the "
                          f"model's targets; use an adapter saved for this model")
    if missing:
        raise ConfigError(f"{file}: missing tensor {missing[0]!r} ({len(missing)} missing in all); the adapter is "
                          f"incomplete or for another model: save it again")
    for key, dest in want.items():
        if loaded[key].shape != dest.shape:
            raise ConfigError(f"{file}: tensor {key!r} has shape {tuple(loaded[key].shape)}, the model's is "
                              f"{tuple(dest.shape)}; the adapter is for another model")
    with torch.no_grad():
        for key, dest in want.items():
            dest.copy_(loaded[key])
    return model
