"""
The Llama family (Llama, Qwen2, Qwen3) against what Hugging Face transformers computed from the same checkpoints
(tests/fixtures/tiny-*-a, see their README-modern.md), the KV cache against full recomputation, the checkpoint
format (lib/hf.py) in and out, and the loader bugs the fixtures are built to expose, planted one at a time.
"""
import json
import math
import os
import shutil

import pytest
import torch
from torch.nn import functional as F
from safetensors.torch import load_file, save_file

import engine
import model as model_module
from lib.measure import flops_per_token
from configurator import ConfigError
from model import GPT, GPTConfig, rope_frequencies
from test_model import PROMPTS, brute_logprobs, record_logits

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FAMILIES = ["tiny-qwen2-a", "tiny-llama-a", "tiny-qwen3-a"]

# These fixtures' logits are large (|logit| up to 9.5), so float32 paths that sum in another order (the cached decode
# step against the full forward, a batch against one row) differ by ~1e-5 in a log-prob, as transformers' own sdpa
# and eager attention do (1.2e-5 on these logits): 1e-5 absolute plus 1e-5 relative. The float64 test below shows
# the paths compute the same function.
LOGP_TOL = dict(atol=1e-5, rtol=1e-5)

@pytest.fixture(scope="module", params=FAMILIES)
def fixture(request):
    path = os.path.join(FIXTURES, request.param)
    ref = load_file(os.path.join(path, "reference.safetensors"))
    return path, GPT.from_pretrained(path, dtype=torch.float32).eval(), ref

def logits_error(model, ref):
    with torch.no_grad():
        return (model.logits(ref["input_ids"]) - ref["logits"]).abs().max().item()

# -----------------------------------------------------------------------------
# what transformers computes

def test_logits_match_hugging_face(fixture):
    _, model, ref = fixture
    assert logits_error(model, ref) < 1e-4

def test_greedy_matches_hugging_face(fixture):
    _, model, ref = fixture
    seen, handle = record_logits(model)
    tokens, mask, _ = model.generate(ref["greedy_prompt"].tolist(), 20, temperature=0)
    handle.remove()
    assert torch.equal(tokens, ref["greedy_new_tokens"]) and mask.all()
    torch.testing.assert_close(torch.cat(seen), ref["greedy_scores"], atol=1e-4, rtol=0)

def test_left_padded_batch_matches_hugging_face(fixture):
    """transformers' batch is left-padded with positions cumsum(mask) - 1; ours prefills each prompt alone into
    right-aligned cache rows, positions counted from each row's first token: the same numbers."""
    _, model, ref = fixture
    prompts = [row[m.bool()].tolist() for row, m in zip(ref["ragged_prompt_ids"], ref["ragged_attention_mask"])]
    assert len(prompts[1]) < len(prompts[0])
    seen, handle = record_logits(model)
    tokens, _, _ = model.generate(prompts, 20, temperature=0)
    handle.remove()
    assert torch.equal(tokens, ref["ragged_new_tokens"])
    steps = torch.stack(seen, 1)  # the prefill's row a prompt, then (2, V) a step
    torch.testing.assert_close(steps, ref["ragged_scores"], atol=1e-4, rtol=0)

def test_bf16_checkpoint_loads_in_its_own_dtype():
    path = os.path.join(FIXTURES, "tiny-llama-a")
    ref = load_file(os.path.join(path, "reference.safetensors"))
    model = GPT.from_pretrained(path).eval()
    assert model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model.logits(ref["input_ids"])
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - ref["logits_bf16"].float()).abs().max() < 0.5  # README-modern's bf16 tolerance

def test_meta_device_reads_the_shape_only(tmp_path):
    """FSDP's ranks but the first build the model with device='meta' (train.py): from config.json alone, no weights
    read and no memory taken, the same names, shapes and dtypes as the loaded model."""
    path = os.path.join(FIXTURES, "tiny-qwen2-a")
    shutil.copy(os.path.join(path, "config.json"), tmp_path)  # no weights file at all
    meta = GPT.from_pretrained(str(tmp_path), dtype=torch.float32, device="meta")
    real = GPT.from_pretrained(path, dtype=torch.float32)
    assert all(t.is_meta for t in meta.state_dict().values())
    assert {k: (t.shape, t.dtype) for k, t in meta.state_dict().items()} == \
        {k: (t.shape, t.dtype) for k, t in real.state_dict().items()}

# -----------------------------------------------------------------------------
# the KV cache: full recomputation, one prompt alone, the trainer's log-prob path

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_equals_uncached(fixture, temperature):
    _, model, _ = fixture
    tokens, mask, logps = model.generate(PROMPTS, 10, num_samples=2, temperature=temperature,
                                         generator=torch.Generator().manual_seed(1))
    ref_tokens, _, ref_logps = model.generate(PROMPTS, 10, plain=True, num_samples=2, temperature=temperature,
                                               generator=torch.Generator().manual_seed(1))
    assert torch.equal(tokens, ref_tokens) and mask.all()
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=0)

def test_batch_equals_each_prompt_alone(fixture):
    _, model, _ = fixture
    gens = lambda ids: [torch.Generator().manual_seed(50 + i) for i in ids]
    # a set of eos ids, as Qwen's instruct models stop on two: the model's two most frequent tokens, so rows end
    tokens, _, _ = model.generate(PROMPTS, 24, num_samples=3, generator=gens(range(4)))
    eos = tokens.flatten().bincount().topk(2).indices.tolist()
    tokens, mask, logps = model.generate(PROMPTS, 24, num_samples=3, eos_id=eos, generator=gens(range(4)))
    assert not mask.all()
    for i, prompt in enumerate(PROMPTS):
        t, m, lp = model.generate([prompt], 24, num_samples=3, eos_id=eos, generator=gens([i]))
        rows, L = slice(3 * i, 3 * i + 3), t.size(1)
        assert torch.equal(tokens[rows, :L], t) and torch.equal(mask[rows, :L], m) and not mask[rows, L:].any()
        torch.testing.assert_close(logps[rows, :L], lp, **LOGP_TOL)
    ends = tokens[mask & ~torch.roll(mask, -1, 1) & (mask.sum(1, keepdim=True) < tokens.size(1))]
    assert set(ends.tolist()) <= set(eos)  # every row that stops, stops on one of the eos ids

def trainer_logprobs(model, tokens):
    """The trainer's log-probs at temperature 0.8 of the completions `tokens` that generate sampled for PROMPTS, 2
    samples each: each row's prompt and completion, right-padded."""
    rows = [p for p in PROMPTS for _ in range(2)]
    idx = torch.zeros(len(rows), max(map(len, rows)) + tokens.size(1), dtype=torch.long)
    for r, p in enumerate(rows):
        idx[r, :len(p) + tokens.size(1)] = torch.tensor(p + tokens[r].tolist())
    with torch.no_grad():
        return model.logprobs(idx, torch.tensor(list(map(len, rows))), tokens.size(1), 0.8)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_generate_logprobs_equal_the_trainer_path(fixture, dtype):
    path, model, _ = fixture
    model = model if dtype == torch.float32 else GPT.from_pretrained(path, dtype=dtype).eval()
    tokens, mask, logps = model.generate(PROMPTS, 10, num_samples=2, temperature=0.8,
                                         generator=torch.Generator().manual_seed(0))
    ref = trainer_logprobs(model, tokens)
    tol = LOGP_TOL if dtype == torch.float32 else dict(atol=1e-6, rtol=0)  # sample() reports float32 log-probs
    torch.testing.assert_close(logps[mask], ref[mask].float(), **tol)

def test_generate_under_bf16_autocast(fixture):
    """Under autocast rotary keeps q and k in float32 (cos and sin are, as in HF's code) while the cache is bf16: the
    decode step writes them in the cache's dtype. The sampler's log-probs stay near the trainer's under the same
    autocast (bf16 rounding of logits of size ~10: a few hundredths), measured 0.008-0.011 mean, 0.048 max here."""
    _, model, _ = fixture
    with torch.autocast("cpu", torch.bfloat16):
        tokens, mask, logps = model.generate(PROMPTS, 10, num_samples=2, temperature=0.8,
                                             generator=torch.Generator().manual_seed(0))
        ref = trainer_logprobs(model, tokens)
    diff = (logps[mask] - ref[mask]).abs()
    assert diff.mean() < 0.025 and diff.max() < 0.1

def test_cache_holds_only_the_kv_heads():
    """Grouped-query attention's memory saving: the cache is (rows, kv heads, S, head_dim), not query heads."""
    model = GPT.from_pretrained(os.path.join(FIXTURES, "tiny-qwen3-a"), dtype=torch.float32).eval()
    model.decode_graphs = True  # the cache is kept after the call (on the CPU no graph is captured)
    model.generate([[1, 2, 3]], 4, num_samples=2)
    assert engine._CACHES[model]["kv"][0][0].shape == (2, 3, 3 + 4 - 1, 24)  # 6 query heads, 3 kv heads, hs 24

# -----------------------------------------------------------------------------
# training-side pieces: activation checkpointing, the log-prob pass at Qwen's vocabulary, FLOPs

def small(**kw):
    return GPTConfig(**dict(dict(model_type="qwen3", block_size=64, vocab_size=300, n_layer=2, n_head=4,
                                 n_kv_head=2, head_dim=12, n_embd=32, n_inner=40, qk_norm=True), **kw))

def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = GPT(small()).double()
    idx, start = torch.randint(0, 300, (3, 30)), torch.tensor([4, 9, 2])
    grads = []
    for flag in (False, True):
        model.gradient_checkpointing = flag
        model.zero_grad()
        lp = model(idx, start, 20)
        lp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)

def test_logprobs_at_qwen_vocabulary():
    torch.manual_seed(0)
    model = GPT(small(vocab_size=151936, n_layer=1, block_size=256))
    idx, start = torch.randint(0, 151936, (2, 300 // 2)), torch.tensor([3, 7])
    with torch.no_grad():
        torch.testing.assert_close(model.logprobs(idx, start, 120, 1.0), brute_logprobs(model, idx, start, 120, 1.0),
                                   atol=1e-5, rtol=0)

@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_counts_gqa_swiglu_and_the_head(tie):
    """Brute force: 2 FLOPs per multiply-add of every nn.Linear a token goes through (hooked), plus attention."""
    torch.manual_seed(0)
    cfg = small(tie_word_embeddings=tie, qkv_bias=True)
    model, T, macs = GPT(cfg), 16, []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, i, o: macs.append(mod.in_features * mod.out_features))
    with torch.no_grad():
        model.logits(torch.zeros(1, 1, dtype=torch.long))  # one token through every matmul
    attention = cfg.n_layer * 2 * 2 * cfg.n_head * cfg.head_dim * T  # q.k scores and the mix, over T keys
    biases_and_norms = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1)
    assert flops_per_token(model, T, backward=False) == 2 * (sum(macs) + biases_and_norms) + attention

# -----------------------------------------------------------------------------
# rotary scaling: Llama-3.1's, against Meta's per-frequency loop

def test_llama3_rope_scaling_matches_a_loop():
    s = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    cfg = GPTConfig(model_type="llama", n_embd=2048, n_head=32, rope_theta=500000.0, rope_scaling=s)
    base = [1.0 / 500000.0 ** (i / 64) for i in range(0, 64, 2)]
    low, high = 8192 / s["low_freq_factor"], 8192 / s["high_freq_factor"]
    want = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < high:
            want.append(f)
        elif wavelen > low:
            want.append(f / s["factor"])
        else:
            smooth = (8192 / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            want.append((1 - smooth) * f / s["factor"] + smooth * f)
    got = rope_frequencies(cfg, "cpu").double()
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    assert (got < torch.tensor(base, dtype=torch.float64) * 0.99).any()  # the scaling did something

# -----------------------------------------------------------------------------
# the checkpoint format: round trips, both config layouts, every bad checkpoint's one-line error

def tensors_of(path):
    files = [f for f in os.listdir(path) if f.endswith(".safetensors") and f != "reference.safetensors"]
    return {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}

@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("shard", [None, 100_000])
def test_save_load_round_trip_is_bit_exact(name, shard, tmp_path):
    src = os.path.join(FIXTURES, name)
    model = GPT.from_pretrained(src)  # the checkpoint's own dtype: bf16 for tiny-llama-a
    model.save_pretrained(tmp_path, **({} if shard is None else dict(max_shard_size=shard)))
    files = sorted(os.listdir(tmp_path))
    if shard:
        assert "model.safetensors.index.json" in files and "model.safetensors" not in files
        index = json.load(open(tmp_path / "model.safetensors.index.json"))
        assert len(set(index["weight_map"].values())) > 2
    else:
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    saved, original = tensors_of(tmp_path), tensors_of(src)
    assert saved.keys() == original.keys()  # the same names, lm_head only when untied
    assert all(saved[k].dtype == original[k].dtype and torch.equal(saved[k], original[k]) for k in saved)
    config, old = json.load(open(tmp_path / "config.json")), json.load(open(os.path.join(src, "config.json")))
    assert {k: v for k, v in config.items() if k in old and k != "transformers_version"} == \
        {k: v for k, v in old.items() if k != "transformers_version"}
    assert ("rope_theta" in config) == ("rope_theta" in old) and ("dtype" in config) == ("dtype" in old)
    again = GPT.from_pretrained(tmp_path)
    assert again.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    model.save_pretrained(tmp_path)  # back to one file: the shards and index of the earlier save are gone
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("model")) == ["model.safetensors"]

def test_config_layouts_read_the_same(tmp_path):
    """transformers 5's rope_parameters/dtype and transformers 4's rope_theta/torch_dtype are one model; a config
    that never names rope_theta gets the default 10000, which the fixture's logits would expose."""
    src = os.path.join(FIXTURES, "tiny-qwen3-a")
    path = copy(src, tmp_path)
    config = json.load(open(path / "config.json"))
    theta = config["rope_parameters"]["rope_theta"]
    del config["rope_parameters"]
    config.update(rope_theta=theta, rope_scaling=None, torch_dtype=config.pop("dtype"))
    (path / "config.json").write_text(json.dumps(config))
    assert GPT.from_pretrained(path).config == GPT.from_pretrained(src).config

def copy(src, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    return path

def edit_json(file, fn):
    obj = json.load(open(file))
    fn(obj)
    file.write_text(json.dumps(obj))

def edit_shard(file, fn):
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)

LLAMA, QWEN2, SHARD2 = "tiny-llama-a", "tiny-qwen2-a", "model-00002-of-00003.safetensors"
LAYER0 = "model.layers.0."
BAD = {
    "rope type": (QWEN2, lambda p: edit_json(p / "config.json", lambda c: c["rope_parameters"].update(
        rope_type="yarn")), r"config.json: rope type 'yarn' is not supported"),
    "old rope type": (LLAMA, lambda p: edit_json(p / "config.json", lambda c: c.update(rope_scaling=dict(type="dynamic",
                      factor=2.0))), r"config.json: rope type 'dynamic' is not supported"),
    "sliding window": (QWEN2, lambda p: edit_json(p / "config.json", lambda c: c.update(use_sliding_window=True,
                       sliding_window=64)), r"config.json: sliding-window attention is on \(sliding_window=64\)"),
    "mistral window": (LLAMA, lambda p: edit_json(p / "config.json", lambda c: c.update(model_type="mistral",
                       sliding_window=128)), r"sliding-window attention is on"),
    "missing key": (QWEN2, lambda p: edit_json(p / "config.json", lambda c: c.pop("intermediate_size")),
                    r"config.json: missing key 'intermediate_size'"),
    "missing shard": (LLAMA, lambda p: os.remove(p / SHARD2),
                      rf"model.safetensors.index.json names the shard {SHARD2}, but .* is missing"),
    "missing tensor": (QWEN2, lambda p: edit_shard(p / "model.safetensors", lambda t: t.pop(
        LAYER0 + "self_attn.q_proj.bias")),
        r"model.safetensors: missing tensor 'model.layers.0.self_attn.q_proj.bias'"),
    "extra tensor": (LLAMA, lambda p: edit_shard(p / SHARD2, lambda t: t.update(x=torch.zeros(2))),
                     rf"{SHARD2}: holds tensor 'x', but .*index.json maps it to None"),
    "misshaped": (QWEN2, lambda p: edit_shard(p / "model.safetensors", lambda t: t.update(
        {LAYER0 + "self_attn.k_proj.weight": torch.zeros(80, 80)})),
        r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(80, 80\), "
        r"expected \(16, 80\)"),
    "unexpected tensor": (QWEN2, lambda p: edit_shard(p / "model.safetensors", lambda t: t.update(
        {LAYER0 + "self_attn.o_proj.bias": torch.zeros(80)})),
        r"model.safetensors: unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"),
    "index points elsewhere": (LLAMA, lambda p: edit_json(p / "model.safetensors.index.json", lambda i: i[
        "weight_map"].update({"model.norm.weight": SHARD2})),
        r"'model.norm.weight'.*the index and the shards disagree"),
    "index names a tensor its shard lacks": (LLAMA, lambda p: edit_json(p / "model.safetensors.index.json",
        lambda i: i["weight_map"].update({"model.extra.weight": SHARD2})),
        rf"index.json maps tensor 'model.extra.weight' to {SHARD2}, which does not hold it"),
    "untied head in a tied config": (QWEN2, lambda p: edit_shard(p / "model.safetensors", lambda t: t.update(
        {"lm_head.weight": torch.zeros(640, 80)})), r"lm_head.weight differs from the token embedding"),
}

@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoint_is_one_clear_line(case, tmp_path):
    name, damage, error = BAD[case]
    path = copy(os.path.join(FIXTURES, name), tmp_path)
    damage(path)
    with pytest.raises(ConfigError, match=error) as e:
        GPT.from_pretrained(path)
    assert "\n" not in str(e.value)

# -----------------------------------------------------------------------------
# the bugs loaders make: each one planted must move the logits far outside the 1e-4 the tests above allow

def interleaved(x, cos, sin):
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    half = cos[..., : x.size(-1) // 2].repeat_interleave(2, -1), sin[..., : x.size(-1) // 2].repeat_interleave(2, -1)
    return x * half[0] + rotated * half[1]

def tiled_gqa(sdpa):
    def attend(q, k, v, *args, enable_gqa=False, **kw):
        if enable_gqa:  # query head h on kv head h % kv_heads instead of h // (heads / kv_heads)
            k, v = (t.repeat(1, q.size(1) // t.size(1), 1, 1) for t in (k, v))
        return sdpa(q, k, v, *args, **kw)
    return attend

PLANTED = {
    "biases ignored": ("tiny-qwen2-a", lambda m, mp: [b.attn.c_attn.bias.data.zero_() for b in m.transformer.h]),
    "norm weights ignored": ("tiny-llama-a", lambda m, mp: [b.ln_1.weight.data.fill_(1) for b in m.transformer.h]),
    "q/k norm weights ignored": ("tiny-qwen3-a", lambda m, mp: [b.attn.q_norm.weight.data.fill_(1)
                                                                for b in m.transformer.h]),
    "interleaved rotary": ("tiny-llama-a", lambda m, mp: mp.setattr(model_module, "rotate", interleaved)),
    "GQA tiled": ("tiny-qwen3-a", lambda m, mp: mp.setattr(F, "scaled_dot_product_attention",
                                                           tiled_gqa(F.scaled_dot_product_attention))),
    "rope_theta not read": ("tiny-llama-a", lambda m, mp: mp.setattr(m.config, "rope_theta", 10000.0)),
}

@pytest.mark.parametrize("bug", PLANTED)
def test_planted_loader_bug_is_caught(bug, monkeypatch):
    name, plant = PLANTED[bug]
    path = os.path.join(FIXTURES, name)
    model = GPT.from_pretrained(path, dtype=torch.float32).eval()
    ref = load_file(os.path.join(path, "reference.safetensors"))
    assert logits_error(model, ref) < 1e-4
    plant(model, monkeypatch)
    assert logits_error(model, ref) > 1e-2

def test_mistral_without_a_window_is_the_llama_code_path(tmp_path):
    path = copy(os.path.join(FIXTURES, "tiny-llama-a"), tmp_path)
    edit_json(path / "config.json", lambda c: c.update(model_type="mistral", sliding_window=None))
    model = GPT.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.model_type == "mistral"
    assert logits_error(model, load_file(path / "reference.safetensors")) < 1e-4
    model.save_pretrained(tmp_path / "again")
    assert json.load(open(tmp_path / "again" / "config.json"))["architectures"] == ["MistralForCausalLM"]
