"""
lib/lora.py against independent references: the base model (zero adapters, adapters_off), W x + b + (alpha/r) B A x
computed by hand per part, the unmerged forward against merged weights, and PEFT's file layout, whose merge into the
fixtures' own Hugging Face tensors (read from disk, Conv1D transposes included) must give our merged model's weights.
"""
import json
import os
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file, save_file

from lib import checkpoint
import engine
from lib import lora
from model import GPT

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LLAMA_PARTS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(name):
    return GPT.from_pretrained(os.path.join(FIXTURES, name), dtype=torch.float64)


def adapted(name, targets="all-linear", rank=4, alpha=8.0, dropout=0.0, seed=0, random_b=True):
    """A fixture model with adapters, in eval mode; random_b: B drawn non-zero, so the adapters change the
    function."""
    torch.manual_seed(seed)
    model = lora.add_lora(load(name), rank, alpha, dropout, targets)
    if random_b:
        with torch.no_grad():
            for m in lora.lora_modules(model):
                for B in m.lora_B:
                    B.normal_(0, 0.2)
    return model.eval()


def batch(model, B=3, T=12, seed=1):
    """Random token ids (B, T) and each row's prompt length (B,): the input of logprobs."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(model.config.vocab_size, (B, T), generator=g)
    start = torch.randint(2, T // 2, (B,), generator=g)
    return idx, start, T - int(start.max())


def logps(model, idx, start, length):
    with torch.no_grad():
        return model.logprobs(idx, start, length)


def one_line_error(fn, *needles):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg

# -----------------------------------------------------------------------------
# the function the adapted model computes


@pytest.mark.parametrize("name", ["tiny-gpt2-a", "tiny-qwen3-a"])
def test_zero_adapters_are_the_base_model(name):
    base = load(name)
    model = adapted(name, dropout=0.1, random_b=False).train()  # dropout on: B = 0 must hide it too
    base.train()
    idx, start, length = batch(base)
    with torch.no_grad():
        assert torch.equal(model.logits(idx), base.logits(idx))
    assert torch.equal(logps(model, idx, start, length), logps(base, idx, start, length))


@pytest.mark.parametrize("name,targets,expect", [
    ("tiny-llama-a", ["q_proj", "v_proj"], {"attn.c_attn": ["q_proj", "v_proj"]}),
    ("tiny-qwen2-a", "all-linear", {"attn.c_attn": ["q_proj", "k_proj", "v_proj"], "attn.c_proj": ["o_proj"],
                                    "mlp.c_fc": ["gate_proj", "up_proj"], "mlp.c_proj": ["down_proj"]}),
    ("tiny-gpt2-a", ["c_proj"], {"attn.c_proj": ["c_proj"], "mlp.c_proj": ["c_proj"]}),  # PEFT's suffix match
    ("tiny-gpt2-a", ["attn.c_proj"], {"attn.c_proj": ["c_proj"]}),
    ("tiny-gpt2-a", "all-linear", {"attn.c_attn": ["c_attn"], "attn.c_proj": ["c_proj"], "mlp.c_fc": ["c_fc"],
                                   "mlp.c_proj": ["c_proj"]}),
])
def test_targets_adapt_what_they_name(name, targets, expect):
    model = adapted(name, targets, random_b=False)
    for i, block in enumerate(model.transformer.h):
        for sub in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            m = block.get_submodule(sub)
            if sub not in expect:
                assert type(m) is torch.nn.Linear
                continue
            assert isinstance(m, lora.LoRALinear)
            assert [p[0].rsplit(".", 1)[-1] for p in m.parts] == expect[sub]
            assert all(f".{i}." in p[0] for p in m.parts)
    assert type(model.lm_head) is torch.nn.Linear  # never the output layer
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in lora.lora_parameters(model)} and trainable
    assert lora.has_adapters(model) and not lora.has_adapters(load(name))


@pytest.mark.parametrize("name,targets", [("tiny-llama-a", ["q_proj", "v_proj"]), ("tiny-qwen2-a", "all-linear"),
                                          ("tiny-gpt2-a", "all-linear")])
def test_linear_equals_hand_reference(name, targets):
    """y = W x + b, plus (alpha/r) B_p (A_p x) on each targeted part's rows; untargeted rows exactly W x + b."""
    model = adapted(name, targets, rank=3, alpha=5.0)
    base = load(name)
    x = torch.randn(2, 5, model.config.n_embd, dtype=torch.float64)
    for sub in ("attn.c_attn", "mlp.c_fc"):
        m, ref_lin = model.transformer.h[1].get_submodule(sub), base.transformer.h[1].get_submodule(sub)
        if not isinstance(m, lora.LoRALinear):
            continue
        with torch.no_grad():
            y, plain = m(x), ref_lin(x)  # (2, 5, out)
        covered = torch.zeros(m.out_features, dtype=torch.bool)
        for i, (_, first, rows) in enumerate(m.parts):
            A, B = m.lora_A[i * 3:(i + 1) * 3], m.lora_B[i]  # (3, in), (rows, 3)
            expect = x @ ref_lin.weight[first:first + rows].T + (5.0 / 3) * (x @ A.T) @ B.T
            if ref_lin.bias is not None:
                expect = expect + ref_lin.bias[first:first + rows]
            torch.testing.assert_close(y[..., first:first + rows], expect, rtol=1e-12, atol=1e-12)
            assert not torch.allclose(y[..., first:first + rows], plain[..., first:first + rows])
            covered[first:first + rows] = True
        assert torch.equal(y[..., ~covered], plain[..., ~covered])
        if targets == ["q_proj", "v_proj"]:  # k's rows are the untargeted ones
            q, kv = model.config.n_head * model.config.head_dim, model.config.n_kv_head * model.config.head_dim
            assert covered.tolist() == [True] * q + [False] * kv + [True] * kv


def test_dropout_is_on_the_adapter_input_in_training_only():
    model = adapted("tiny-qwen2-a", ["o_proj"], dropout=0.5)
    m = model.transformer.h[0].attn.c_proj
    x = torch.randn(4, 80, dtype=torch.float64)
    with torch.no_grad():
        base = x @ m.weight.T
        model.eval()
        clean = m(x)
        model.train()
        torch.manual_seed(3)
        noisy = m(x)
        torch.manual_seed(3)
        kept = torch.nn.functional.dropout(x, 0.5, training=True)  # the same draw as the module's
    torch.testing.assert_close(clean, base + 2.0 * (x @ m.lora_A.T) @ m.lora_B[0].T)
    torch.testing.assert_close(noisy, base + 2.0 * (kept @ m.lora_A.T) @ m.lora_B[0].T)
    assert not torch.allclose(noisy, clean)


@pytest.mark.parametrize("name", ["tiny-gpt2-a", "tiny-llama-a"])
def test_adapters_off_is_the_base_model(name):
    model, base = adapted(name), load(name)
    idx, start, length = batch(model)
    on = logps(model, idx, start, length)
    with lora.adapters_off(model):
        off = logps(model, idx, start, length)
    assert torch.equal(off, logps(base, idx, start, length))
    assert (on - off).abs().max() > 1e-3  # the adapters do change the policy
    assert torch.equal(logps(model, idx, start, length), on)  # and are back on after


# -----------------------------------------------------------------------------
# merged weights for generation


@pytest.mark.parametrize("name,targets", [("tiny-gpt2-a", "all-linear"), ("tiny-qwen2-a", ["q_proj", "v_proj",
                                                                                            "up_proj"])])
def test_merged_generates_as_unmerged_and_restores_bitwise(name, targets):
    model = adapted(name, targets).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = [[5, 17, 200], [1, 2, 3, 4, 5, 6, 7], [42]]
    tokens, mask, lp = model.generate(prompts, 12, num_samples=2, temperature=0)
    idx, start, length = batch(model)
    with lora.merged(model):
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        tokens_m, mask_m, lp_m = model.generate(prompts, 12, num_samples=2, temperature=0)
        merged_logps = logps(model, idx, start, length)
    assert torch.equal(tokens_m, tokens) and torch.equal(mask_m, mask)
    torch.testing.assert_close(lp_m, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged_logps, logps(model, idx, start, length), atol=1e-5, rtol=0)
    # inside: exactly the targeted weights moved; after: every tensor bitwise as before
    targeted = {f"transformer.h.{i}.{s}.weight" for i, b in enumerate(model.transformer.h)
                for s in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
                if isinstance(b.get_submodule(s), lora.LoRALinear)}
    assert set(changed) == targeted
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("name,targets", [("tiny-gpt2-a", "all-linear"), ("tiny-qwen2-a", ["k_proj", "up_proj"])])
def test_merged_state_dict_is_the_merged_model(name, targets, tmp_path):
    """What a checkpoint's merged/ holds: saved and loaded as a plain model, it computes what the adapted model does
    (to rounding), and building it left the live weights untouched."""
    model = adapted(name, targets)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = lora.merged_state_dict(model, model.state_dict())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with lora.merged(model):  # the in-place merge of generation: the same weights
        live = model.state_dict()
        assert max((sd[k] - live[k]).abs().max().item() for k in live if ".lora_" not in k) < 1e-12
    model.save_pretrained(tmp_path, state_dict=sd)
    idx, start, length = batch(model)
    torch.testing.assert_close(logps(GPT.from_pretrained(tmp_path), idx, start, length),
                               logps(model, idx, start, length), atol=1e-10, rtol=0)


def test_decode_step_compiles_once_per_mode():
    """train.py compiles generate's decode step with fullgraph: the adapters add no graph break, and switching them
    off (merged, adapters_off) is one more graph, not one per call. Dynamo's eager backend: tracing, no codegen."""
    model = adapted("tiny-llama-a", ["q_proj", "v_proj", "down_proj"])
    prompts = [[5, 17, 200], [1, 2, 3, 4, 5, 6, 7]]
    run = lambda: model.generate(prompts, 10, num_samples=2, generator=torch.Generator().manual_seed(0))
    eager = run()
    with lora.merged(model):
        eager_merged = run()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.decode = torch.compile(model.decode, fullgraph=True, backend="eager")
    traced = run()
    with lora.merged(model):
        traced_merged = run()
    with lora.adapters_off(model):
        run()
    again = run()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    for a, b, c in zip(eager, traced, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(eager_merged, traced_merged):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_merged_and_adapters_off_do_not_nest():
    model = adapted("tiny-qwen3-a")
    with lora.merged(model), pytest.raises(RuntimeError):
        with lora.adapters_off(model):
            pass
    with lora.adapters_off(model), pytest.raises(RuntimeError):
        with lora.merged(model):
            pass
    assert all(m.active and not m.merged for m in lora.lora_modules(model))


# -----------------------------------------------------------------------------
# training


@pytest.mark.parametrize("name", ["tiny-gpt2-a", "tiny-qwen2-a"])
def test_adamw_step_moves_only_the_adapters(name):
    model = adapted(name).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    idx, start, length = batch(model)
    (-model(idx, start, length).sum()).backward()
    opt.step()
    adapter_keys = {k for k in before if ".lora_" in k}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) == (k not in adapter_keys), k
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)


# -----------------------------------------------------------------------------
# PEFT's files


def hf_tensors(name):
    path = os.path.join(FIXTURES, name)
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else \
        ["model.safetensors"]
    return {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}


@pytest.mark.parametrize("name,targets,keys", [
    ("tiny-qwen2-a", "all-linear", {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 80),
        "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": (16, 4),
        "base_model.model.model.layers.2.self_attn.o_proj.lora_B.weight": (80, 4),
        "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight": (224, 4),
        "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight": (4, 224)}),
    ("tiny-llama-a", ["q_proj", "v_proj"], {
        "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight": (64, 4),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 128)}),
    ("tiny-gpt2-a", "all-linear", {
        "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": (4, 64),
        "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight": (192, 4),
        "base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight": (4, 256),
        "base_model.model.transformer.h.1.attn.c_proj.lora_B.weight": (64, 4)}),
])
def test_peft_files_round_trip(name, targets, keys, tmp_path):
    model = adapted(name, targets, dropout=0.05)
    lora.save_adapter(model, tmp_path, "org/base")
    config = json.load(open(tmp_path / "adapter_config.json"))
    gpt2 = name == "tiny-gpt2-a"
    assert config == dict(config, peft_type="LORA", task_type="CAUSAL_LM", r=4, lora_alpha=8.0, lora_dropout=0.05,
                          bias="none", fan_in_fan_out=gpt2, base_model_name_or_path="org/base", inference_mode=True,
                          use_rslora=False, init_lora_weights=True, modules_to_save=None)
    names = (["c_attn", "c_proj", "c_fc"] if gpt2 else LLAMA_PARTS) if targets == "all-linear" else targets
    assert sorted(config["target_modules"]) == sorted(names)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert {k: tuple(tensors[k].shape) for k in keys} == keys
    modules = {k.rsplit(".lora_", 1)[0] for k in tensors}
    assert len(tensors) == 2 * len(modules) == 2 * model.config.n_layer * len(names) + (2 * 2 if gpt2 else 0)

    # PEFT's merge of these files into the checkpoint's own tensors is our merged model, saved
    base = hf_tensors(name)
    with lora.merged(model):
        model.save_pretrained(tmp_path / "merged")
    ours = hf_tensors(tmp_path / "merged")
    for module in modules:
        w, delta = base[module.removeprefix("base_model.model.") + ".weight"], 2.0 * (
            tensors[module + ".lora_B.weight"] @ tensors[module + ".lora_A.weight"])  # (out, in)
        expect = w + (delta.T if config["fan_in_fan_out"] else delta)  # Conv1D stores (in, out)
        torch.testing.assert_close(ours[module.removeprefix("base_model.model.") + ".weight"], expect)

    fresh = adapted(name, targets, dropout=0.05, seed=7, random_b=False)
    lora.load_adapter(fresh, tmp_path)
    want = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    got = {k: v for k, v in fresh.state_dict().items() if ".lora_" in k}
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    idx, start, length = batch(model)
    assert torch.equal(logps(fresh, idx, start, length), logps(model, idx, start, length))


def test_save_pretrained_writes_the_base_model_only(tmp_path):
    name = "tiny-llama-a"
    model = adapted(name)
    load(name).save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapted")
    files = sorted(os.listdir(tmp_path / "base"))
    assert sorted(os.listdir(tmp_path / "adapted")) == files
    for f in files:
        assert (tmp_path / "base" / f).read_bytes() == (tmp_path / "adapted" / f).read_bytes(), f
    again = GPT.from_pretrained(tmp_path / "adapted", dtype=torch.float64)
    base = load(name).state_dict()
    assert all(torch.equal(v, base[k]) for k, v in again.state_dict().items())


def test_decode_graphs_are_kept_per_adapter_state():
    """A replayed CUDA graph runs the kernels of its capture, not the Python that chose them: adapters on and off
    (the reference, or merged into the weights, which the graph reads in place) are different steps, so each gets
    its own graphs. On CPU the replay runs the Python, so the graphs' keys are what shows it."""
    model = adapted("tiny-llama-a")
    model.decode_graphs = True
    prompts, out = [[5, 17, 200], [42]], {}
    modes = dict(on=nullcontext, off=lora.adapters_off, merged=lora.merged, on_again=nullcontext)
    for mode, ctx in modes.items():
        with ctx(model) if ctx is not nullcontext else ctx():
            out[mode] = model.generate(prompts, 10, num_samples=2, generator=torch.Generator().manual_seed(0))[2]
    n = len(lora.lora_modules(model))
    assert {key[-1] for key in engine._CACHES[model]["graphs"]} == {(True,) * n, (False,) * n}
    assert torch.equal(out["on"], out["on_again"]) and not torch.allclose(out["on"], out["off"])
    torch.testing.assert_close(out["merged"], out["on"])


def test_checkpoints_link_the_frozen_base(tmp_path):
    """checkpoint.save with last (the run's last checkpoint): a LoRA run's later checkpoints hard-link the first
    one's base files instead of writing them again; each checkpoint still loads whole once the earlier ones are
    removed. Without adapters last is ignored: a fine-tuned model's weights change."""
    model = adapted("tiny-llama-a")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    checkpoint.save(str(tmp_path), 1, model, opt, None, {})
    inode = lambda it: os.stat(tmp_path / f"ckpt-{it:06d}" / "model.safetensors").st_ino
    first = inode(1)
    for it in (2, 3):
        checkpoint.save(str(tmp_path), it, model, opt, None, {}, last=it - 1)
        assert inode(it) == first and not (tmp_path / f"ckpt-{it - 1:06d}").exists()
    again = GPT.from_pretrained(tmp_path / "ckpt-000003", dtype=torch.float64)
    lora.load_adapter(lora.add_lora(again, 4, 8.0, 0.0, "all-linear"), tmp_path / "ckpt-000003" / "adapter")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())
    plain = load("tiny-llama-a")
    opt = torch.optim.AdamW(plain.parameters())
    checkpoint.save(str(tmp_path), 4, plain, opt, None, {}, last=3)
    assert inode(4) != first


# -----------------------------------------------------------------------------
# errors: one line, naming what is wrong and how to fix it


def test_bad_targets_fail_clearly():
    one_line_error(lambda: adapted("tiny-gpt2-a", ["q_proj"]), "'q_proj'", "c_attn, c_proj, c_fc", "all-linear")
    one_line_error(lambda: adapted("tiny-llama-a", ["q_proj", "c_attn"]), "'c_attn'", ", ".join(LLAMA_PARTS))
    one_line_error(lambda: adapted("tiny-qwen2-a", ["proj"]), "'proj'")  # a suffix of whole names, not of text
    one_line_error(lambda: adapted("tiny-qwen2-a", "q_proj"), "'q_proj'", "list")
    one_line_error(lambda: adapted("tiny-qwen2-a", rank=0), "rank")
    model = adapted("tiny-qwen2-a")
    one_line_error(lambda: lora.add_lora(model, 4, 8.0, 0.0, "all-linear"), "already")
    one_line_error(lambda: lora.save_adapter(load("tiny-qwen2-a"), "x"), "add_lora")


def test_mismatched_or_broken_adapters_fail_clearly(tmp_path):
    name = "tiny-qwen3-a"
    lora.save_adapter(adapted(name, ["q_proj", "v_proj"]), tmp_path)
    one_line_error(lambda: lora.load_adapter(adapted(name, ["q_proj", "v_proj"], rank=8), tmp_path), "r is 4",
                   "rank", "8")
    one_line_error(lambda: lora.load_adapter(adapted(name, ["q_proj", "v_proj"], alpha=16.0), tmp_path),
                   "lora_alpha is 8.0", "16.0")
    one_line_error(lambda: lora.load_adapter(adapted(name, ["q_proj", "k_proj"]), tmp_path), "target_modules",
                   "'k_proj'")
    lora.load_adapter(adapted(name, ["v_proj", "self_attn.q_proj"]), tmp_path)  # the same layers, named otherwise

    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(file)
    gone = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, file)
    model = adapted(name, ["q_proj", "v_proj"])
    before = [p.clone() for p in lora.lora_parameters(model)]
    one_line_error(lambda: lora.load_adapter(model, tmp_path), repr(gone), "missing")
    assert all(torch.equal(p, q) for p, q in zip(lora.lora_parameters(model), before))  # all or nothing
    save_file(dict(tensors, **{gone: tensors[gone][:, :2].contiguous()}), file)
    one_line_error(lambda: lora.load_adapter(adapted(name, ["q_proj", "v_proj"]), tmp_path), repr(gone), "shape")
    extra = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"  # a DoRA adapter's
    save_file(dict(tensors, **{extra: torch.ones(4)}), file)
    one_line_error(lambda: lora.load_adapter(adapted(name, ["q_proj", "v_proj"]), tmp_path), repr(extra),
                   "unexpected")
    config = json.load(open(tmp_path / "adapter_config.json"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(config, use_rslora=True)))
    one_line_error(lambda: lora.load_adapter(adapted(name, ["q_proj", "v_proj"]), tmp_path), "use_rslora")
