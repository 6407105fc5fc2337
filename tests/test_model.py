"""
Tests for model.py against independent references: Hugging Face's own logits for a fixture checkpoint, a no-cache
full-recompute decoder (GPT.generate(plain=True)), brute-force log-softmax loops, and chi-square tests of the sampler.
"""

import copy
import gc
import json
import math
import os
import shutil
import weakref
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
from configurator import ConfigError
from lib.cpu_buffers import _buffers
from lib.head import HeadLogprobs
from lib.measure import flops_per_token, update_flops
from model import GPT, GPTConfig
from sampling import sample
import sampling

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tiny-gpt2-a")
PROMPTS = [[5, 17, 200], [1, 2, 3, 4, 5, 6, 7], [42], [250, 9, 9, 100, 31]]  # ragged on purpose

@pytest.fixture(scope="module")
def tiny():
    return GPT.from_pretrained(FIXTURE).eval()

@pytest.fixture(scope="module")
def reference():
    return load_file(os.path.join(FIXTURE, "reference.safetensors"))

def record_logits(model):
    """Collect every output of the lm_head during a call: generate's per-step logits."""
    seen = []
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.clone()))
    return seen, handle

# -----------------------------------------------------------------------------
# the fixture: what Hugging Face transformers computes from the same checkpoint

def test_logits_match_hugging_face(tiny, reference):
    with torch.no_grad():
        logits = tiny.logits(reference["input_ids"])
    assert logits.shape == reference["logits"].shape
    torch.testing.assert_close(logits, reference["logits"], atol=1e-5, rtol=0)

def test_greedy_matches_hugging_face(tiny, reference):
    seen, handle = record_logits(tiny)
    tokens, mask, _ = tiny.generate(reference["greedy_prompt"].tolist(), 20, temperature=0)
    handle.remove()
    assert torch.equal(tokens, reference["greedy_new_tokens"])
    assert mask.all()
    torch.testing.assert_close(torch.cat(seen), reference["greedy_scores"], atol=1e-5, rtol=0)

# -----------------------------------------------------------------------------
# the KV cache against full recomputation

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_equals_uncached(tiny, temperature):
    steps, G = 12, 2
    seen, handle = record_logits(tiny)
    tokens, mask, logps = tiny.generate(PROMPTS, steps, num_samples=G, temperature=temperature,
                                        generator=torch.Generator().manual_seed(1))
    handle.remove()
    ref_logits, handle = record_logits(tiny)
    ref_tokens, ref_mask, ref_logps = tiny.generate(PROMPTS, steps, num_samples=G, temperature=temperature,
                                                    generator=torch.Generator().manual_seed(1), plain=True)
    handle.remove()
    assert torch.equal(tokens, ref_tokens) and mask.all() and ref_mask.all()
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=0)
    # the prefill logits (a row a prompt, the output layer once for all), then one (N, V) per decode step
    torch.testing.assert_close(seen[0].repeat_interleave(G, 0), ref_logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.stack(seen[1:]), torch.stack(ref_logits[1:]), atol=1e-5, rtol=0)

def test_eos_ends_rows_and_compacts_batch(tiny):
    prompts, steps = [[p, (7 * p) % 257] for p in range(0, 257, 16)], 24  # 17 prompts
    ref_tokens, _, _ = tiny.generate(prompts, steps, plain=True, temperature=0)
    # the token most often seen early in the reference continuations, so that many rows end early
    eos = int(ref_tokens[:, :6].flatten().mode().values)
    seen, handle = record_logits(tiny)
    tokens, mask, logps = tiny.generate(prompts, steps, temperature=0, eos_id=eos)
    handle.remove()
    assert min(out.size(0) for out in seen[1:]) < len(prompts), "finished rows were never dropped"
    for row, ref in zip(range(len(prompts)), ref_tokens):
        ends = (ref == eos).nonzero()
        n = int(ends[0]) + 1 if len(ends) else steps  # real tokens, eos included
        assert mask[row].sum() == n and mask[row, :n].all()
        assert torch.equal(tokens[row, :n], ref[:n])
        assert (tokens[row, n:] == eos).all() and (logps[row, n:] == 0).all()
    assert tokens.size(1) == int(mask.sum(1).max())  # no trailing all-padding steps

@pytest.mark.parametrize("fixture", ["tiny-gpt2-a", "tiny-llama-a"])  # learned positions; rotary and GQA
def test_decode_step_compiles_to_one_graph(fixture):
    """generate's decode step has the same shapes at every step and no graph breaks (fullgraph), so torch.compile
    traces it once for a whole generate call, not once per token. Dynamo's eager backend: tracing without codegen."""
    model = GPT.from_pretrained(os.path.join(os.path.dirname(FIXTURE), fixture), dtype=torch.float32).eval()
    eager = model.generate(PROMPTS, 10, num_samples=2, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.decode = torch.compile(model.decode, fullgraph=True, backend="eager")
    traced = model.generate(PROMPTS, 10, num_samples=2, generator=torch.Generator().manual_seed(0))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)

def test_static_cache_is_kept_and_grown():
    """With graphs the cache outlives a call (a graph needs its addresses fixed): a smaller call reuses it, a larger
    one grows it, and what a call samples does not depend on what earlier calls left in it. Without graphs a call
    frees it (its memory goes to the update), and samples the same."""
    gen = lambda: torch.Generator().manual_seed(0)
    model = GPT.from_pretrained(FIXTURE).eval()
    eager = model.generate(PROMPTS[:1], 8, num_samples=2, generator=gen())
    assert model not in engine._CACHES
    model.decode_graphs = True  # on the CPU: the graph's step called instead of replayed
    first = model.generate(PROMPTS[:1], 8, num_samples=2, generator=gen())
    k = engine._CACHES[model]["kv"][0][0]
    assert k.shape[0] == 2 and model.generate(PROMPTS[:1], 4, generator=gen()) and \
        engine._CACHES[model]["kv"][0][0].data_ptr() == k.data_ptr()  # 1 row, 4 steps: the same cache
    model.generate(PROMPTS, 20, num_samples=3, generator=gen())
    assert engine._CACHES[model]["kv"][0][0].shape[0] == 3 * len(PROMPTS)
    for a, b, c in zip(first, model.generate(PROMPTS[:1], 8, num_samples=2, generator=gen()), eager):
        assert torch.equal(a, b) and torch.equal(a, c)

def test_decode_graphs_sample_the_same(tiny):
    """model.decode_graphs: each decode step replayed from a graph captured once per (rows, width), kept with the
    static cache across calls. On CPU the replay is the step called on the captured inputs (engine._capture), so
    this checks the plumbing: static inputs, outputs overwritten in place, graphs reused across calls, following
    weights changed in place, dropped when a weight moves. tests/test_cuda.py runs the same on CUDA graphs."""
    gen, eos = lambda: torch.Generator().manual_seed(0), 226  # eos: rows end at different steps
    model = GPT.from_pretrained(FIXTURE).eval()
    run = lambda graphs: (setattr(model, "decode_graphs", graphs),
                             model.generate(PROMPTS, 70, num_samples=2, eos_id=eos, generator=gen()))[1]
    eager = lambda: (copy := GPT(model.config), copy.load_state_dict(model.state_dict()), copy.eval(),
                     copy.generate(PROMPTS, 70, num_samples=2, eos_id=eos, generator=gen()))[-1]  # graphs kept

    def same(a, b):  # without graphs finished rows are dropped, so the matmuls' shapes differ: log-probs to 1e-5
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        torch.testing.assert_close(a[2], b[2], atol=1e-5, rtol=0)
    want = run(False)
    assert not want[1].all()
    same(run(True), want)
    replays = lambda: {key: run for key, (_, run) in engine._CACHES[model]["graphs"].items()}
    graphs = replays()
    assert len(graphs) == 2  # 70 steps after prompts of up to 7 tokens: widths 64 and 76, the whole cache
    same(run(True), want)
    assert replays() == graphs  # the same graphs replayed
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # in place, as the optimizer: the graphs read it
    want = eager()
    same(run(True), want)
    assert replays() == graphs
    model.lm_head.weight.data = model.lm_head.weight.data.clone()  # moved: the graphs would read the old copy
    same(run(True), want)
    assert replays().keys() == graphs.keys() and all(replays()[key] is not graphs[key] for key in graphs)

def test_decode_graphs_under_autocast_read_half_copies_of_the_weights(tiny):
    """Under autocast a replayed step reads bf16 copies of the matmuls' weights (engine.half_weights), refreshed at
    every call, instead of casting every weight at every step: the same samples as the eager autocast steps, bit
    for bit, also after the weights change in place; and the captured step really reads the copies."""
    # two models: an eager call frees its cache, which would drop the graphs and copies whose refresh is checked
    model, eager = GPT.from_pretrained(FIXTURE).eval(), GPT.from_pretrained(FIXTURE).eval()
    model.decode_graphs = True

    def run(model):  # no eos: no row finishes early, so eager and graphs run the same shapes
        with torch.autocast("cpu", torch.bfloat16):
            return model.generate(PROMPTS, 20, num_samples=2, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        want, got = run(eager), run(model)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        with torch.no_grad():
            for m in (model, eager):
                m.transformer.h[0].mlp.c_fc.weight.mul_(1.5)  # in place, as the optimizer
    cache = engine._CACHES[model]
    half = cache["half"]
    assert half["model.lm_head.weight"].dtype == torch.bfloat16 and "model.transformer.wte.weight" not in half
    assert "model.transformer.ln_f.weight" not in half and "model.transformer.h.0.attn.c_attn.bias" in half
    _, replay = next(iter(cache["graphs"].values()))
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):  # as captured (on CPU, replay calls the step)
        lp = replay()[1].clone()
        half["model.lm_head.weight"].zero_()  # uniform logits: log-prob -log(vocab) whatever the draw
        assert not torch.equal(replay()[1], lp)
        torch.testing.assert_close(replay()[1], torch.full_like(lp, -math.log(model.config.vocab_size)))


def test_compiled_decode_replayed_under_autocast_samples_the_same():
    """train.py's compile with cuda_graphs under autocast: the compiled decode step, called through functional_call
    on the bf16 copies of the weights (engine._step) and captured once per (rows, width). On CPU the captured step
    is called, not replayed, and dynamo's eager backend traces without codegen: the same samples as the uncompiled
    step, bit for bit, and one trace for two calls of 16 steps, not one per step or per call."""
    gen = lambda: torch.Generator().manual_seed(0)
    models = GPT.from_pretrained(FIXTURE).eval(), GPT.from_pretrained(FIXTURE).eval()
    for m in models:
        m.decode_graphs = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    models[1].decode = torch.compile(models[1].decode, fullgraph=True, backend="eager")
    for _ in range(2):
        with torch.autocast("cpu", torch.bfloat16):
            want, got = [m.generate(PROMPTS, 16, num_samples=2, generator=gen()) for m in models]
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert "model.lm_head.weight" in engine._CACHES[models[1]]["half"]  # the copies exist (that the step reads
    # them is the test above's)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1

def test_the_cache_and_its_graphs_let_the_model_go():
    model = GPT.from_pretrained(FIXTURE).eval()
    model.decode_graphs = True
    model.generate(PROMPTS, 4, num_samples=2)
    assert engine._CACHES[model]["graphs"]
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None

def test_ragged_batch_equals_each_prompt_alone(tiny):
    eos = 226  # frequent in this checkpoint's greedy continuations: rows end at different steps
    tokens, mask, logps = tiny.generate(PROMPTS, 16, temperature=0, eos_id=eos)
    assert not mask.all()
    for row, prompt in enumerate(PROMPTS):
        t, m, lp = tiny.generate([prompt], 16, temperature=0, eos_id=eos)
        L = t.size(1)
        assert torch.equal(tokens[row, :L], t[0]) and torch.equal(mask[row, :L], m[0]) and not mask[row, L:].any()
        torch.testing.assert_close(logps[row, :L], lp[0], atol=1e-5, rtol=0)

def test_per_prompt_generators_make_samples_independent_of_the_batch(tiny):
    """With one generator per prompt, a prompt's samples are the same alone or batched with others: the trainer's
    rollouts then do not depend on how prompts are spread over ranks."""
    gens = lambda ids: [torch.Generator().manual_seed(1000 + i) for i in ids]
    eos = 226
    tokens, mask, logps = tiny.generate(PROMPTS, 12, num_samples=3, eos_id=eos, generator=gens(range(len(PROMPTS))))
    for i, prompt in enumerate(PROMPTS):
        t, m, lp = tiny.generate([prompt], 12, num_samples=3, eos_id=eos, generator=gens([i]))
        rows, L = slice(3 * i, 3 * i + 3), t.size(1)
        assert torch.equal(tokens[rows, :L], t) and torch.equal(mask[rows, :L], m) and not mask[rows, L:].any()
        torch.testing.assert_close(logps[rows, :L], lp, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="2 generators for 3 prompts; give one per prompt"):
        tiny.generate(PROMPTS[:3], 4, generator=gens(range(2)))

@pytest.mark.parametrize("top_k, top_p, new", [(None, None, 10), (20, 0.9, 10), (None, None, 110)])
def test_generate_logprobs_match_trainer_path(tiny, top_k, top_p, new):
    """110 new tokens: the steps attend over the first 64 cache columns, then over all of them."""
    temperature = 0.8
    tokens, mask, logps = tiny.generate(PROMPTS, new, num_samples=3, temperature=temperature, top_k=top_k,
                                        top_p=top_p, eos_id=226, generator=torch.Generator().manual_seed(0))
    rows = [p for p in PROMPTS for _ in range(3)]
    T = max(map(len, rows)) + tokens.size(1)
    idx = torch.full((len(rows), T), 123)  # right padding with an arbitrary id
    for r, p in enumerate(rows):
        idx[r, :len(p) + tokens.size(1)] = torch.tensor(p + tokens[r].tolist())
    start = torch.tensor([len(p) for p in rows])
    with torch.no_grad():
        ref = tiny.logprobs(idx, start, tokens.size(1), temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(logps[mask], ref[mask], atol=1e-5, rtol=0)
    assert (logps[~mask] == 0).all()

def test_samples_of_one_prompt_differ(tiny):
    tokens, _, _ = tiny.generate(PROMPTS, 1, num_samples=16, generator=torch.Generator().manual_seed(0))
    for i in range(len(PROMPTS)):
        assert tokens[16 * i:16 * (i + 1), 0].unique().numel() > 1, f"prompt {i}: all rows drew the same first token"

def test_generate_is_seeded_and_restores_mode(tiny):
    tiny.train()
    a = tiny.generate(PROMPTS, 6, num_samples=2, generator=torch.Generator().manual_seed(3))
    b = tiny.generate(PROMPTS, 6, num_samples=2, generator=torch.Generator().manual_seed(3))
    assert tiny.training
    tiny.eval()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0].dtype == torch.long and a[1].dtype == torch.bool and a[2].dtype == torch.float32

def test_generate_s_check_rejects_bad_prompts(tiny):
    with pytest.raises(ValueError, match=r"prompt 1 \(120 tokens\) \+ max_new_tokens \(10\): 130 tokens, more "
                                         r"than block_size 128"):
        sampling.check_generate(tiny, [[1, 2], [3] * 120], 10)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        sampling.check_generate(tiny, [[]], 5)

# -----------------------------------------------------------------------------
# the trainer's log-prob path against a brute-force log-softmax

def brute_logprobs(model, idx, start, length, temperature):
    logp = torch.log_softmax(model.logits(idx).float() / temperature, -1)  # (B, T, V)
    return torch.stack([logp[b, torch.arange(s - 1, s - 1 + length), idx[b, s:s + length]]
                        for b, s in enumerate(start.tolist())])

def test_logprobs_match_brute_force_with_chunks_and_grad():
    torch.manual_seed(0)
    # a vocabulary of 2**15 makes the chunks 512 rows, so 4 x 150 targets take two of them
    model = GPT(GPTConfig(block_size=160, vocab_size=2**15, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 2**15, (4, 160))
    start, length = torch.tensor([5, 10, 1, 8]), 150
    weights = torch.randn(4, length)
    lp = model.logprobs(idx, start, length, temperature=0.7)
    (lp * weights).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = brute_logprobs(model, idx, start, length, 0.7)
    (ref * weights).sum().backward()
    assert lp.shape == (4, length) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)

# -----------------------------------------------------------------------------
# per-token entropy from the same chunked pass, against a plain full softmax

def plain_head(h, weight, targets, temperature):
    """The full (n, V) log-softmax at once: each row's target log-prob and entropy."""
    logp = torch.log_softmax(h @ weight.t() / temperature, -1)  # (n, V)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)

def head_inputs(dtype, n=23, V=50, C=16):
    g = torch.Generator().manual_seed(0)
    scale = torch.linspace(0.1, 3.0, n, dtype=dtype)[:, None]  # flat to peaked rows: entropies from log V to near 0
    h = (torch.randn(n, C, generator=g, dtype=dtype) * scale).requires_grad_()
    weight = torch.randn(V, C, generator=g, dtype=dtype, requires_grad=True)
    return h, weight, torch.randint(0, V, (n,), generator=g)

HEAD_TOL = {"float64": dict(atol=1e-10, rtol=1e-10), "float32": dict(atol=1e-5, rtol=1e-5)}

@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_chunked_entropy_matches_full_softmax(dtype):
    h, weight, targets = head_inputs(getattr(torch, dtype))
    with torch.no_grad():
        # 5 rows a chunk: the 23 rows are four full chunks and a ragged one of 3
        lp, ent = HeadLogprobs.apply(h, weight, targets, 0.7, 5, h.dtype, True)
        only = HeadLogprobs.apply(h, weight, targets, 0.7, 5, h.dtype, False)
        ref_lp, ref_ent = plain_head(h.double(), weight.double(), targets, 0.7)
    assert ent.shape == (23,) and ref_ent.min() < 0.5 and ref_ent.max() > 3.5  # log 50 = 3.9
    torch.testing.assert_close(ent.double(), ref_ent, **HEAD_TOL[dtype])
    torch.testing.assert_close(lp.double(), ref_lp, **HEAD_TOL[dtype])
    assert isinstance(only, torch.Tensor) and torch.equal(only, lp)  # entropy=False: the log-probs alone, the same

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("used", ["both", "logp only", "entropy only", "entropy weighted 0"])
@pytest.mark.parametrize("keep", [False, True])
def test_chunked_entropy_gradient(dtype, used, keep):
    """d sum(a * logp + b * entropy) / d h, weight; an output the loss leaves out gets no gradient (None). Backward
    from the logits forward kept (keep) gives exactly what it gives recomputing them."""
    h, weight, targets = head_inputs(getattr(torch, dtype))
    a, b = torch.randn(2, 23, dtype=h.dtype, generator=torch.Generator().manual_seed(1))

    def loss(lp, ent):
        if used == "logp only":
            return (a * lp).sum()
        if used == "entropy only":
            return (b * ent).sum()
        return (a * lp + (0 if used == "entropy weighted 0" else b) * ent).sum()  # zeros, not None, for the 0

    out = HeadLogprobs.apply(h, weight, targets, 0.7, 5, h.dtype, True, keep)
    grads = torch.autograd.grad(loss(*out), (h, weight), retain_graph=True)
    ref = torch.autograd.grad(loss(*plain_head(h, weight, targets, 0.7)), (h, weight))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, **HEAD_TOL[dtype])
    if keep:  # exactly what recomputing gives, and again in a second backward through the same graph
        again = torch.autograd.grad(loss(*HeadLogprobs.apply(h, weight, targets, 0.7, 5, h.dtype, True)), (h, weight))
        twice = torch.autograd.grad(loss(*out), (h, weight))
        assert all(torch.equal(g, x) and torch.equal(g, y) for g, x, y in zip(grads, again, twice))

def test_head_chunks_reuse_buffers_no_live_tensor_holds():
    """On CPU the output layer writes its (n, V) chunks into kept buffers: a second identical call takes the first
    call's buffers (none added) and gives the same numbers, and a buffer whose logits a live graph keeps is never
    handed out, so that graph's backward after other calls still reads its own logits."""
    h, weight, targets = head_inputs(torch.float32, V=41)  # a vocabulary no other test uses: buffers of its own
    mine = lambda: sum(b.shape == (5, 41) for b in _buffers)

    def call(keep=True):
        lp, ent = HeadLogprobs.apply(h, weight, targets, 0.7, 5, h.dtype, True, keep)  # five chunks of 5 rows
        return lp, ent, torch.autograd.grad(lp.sum() + ent.sum(), (h, weight))

    with torch.inference_mode():  # as rollout's log-prob pass: buffers it makes are written outside it later
        HeadLogprobs.apply(h, weight, targets, 0.7, 5, h.dtype, True, False)
    first = call()
    used = mine()  # five chunks' logits kept, forward's log-softmax and exp, backward's reusing those two
    assert used == 7 and all(torch.equal(a, b) for a, b in zip(first[2], call()[2])) and mine() == used
    held = HeadLogprobs.apply(h, weight, targets, 0.7, 5, h.dtype, True, True)  # keeps five buffers till backward
    for keep in (True, False):
        assert all(torch.equal(a, b) for a, b in zip(first, call(keep)[:2]))
    again = torch.autograd.grad(held[0].sum() + held[1].sum(), (h, weight))
    assert mine() == used + 5 and all(torch.equal(a, b) for a, b in zip(first[2], again))

def brute_logprobs_entropy(model, idx, start, length, temperature):
    """Every position's full log-softmax in the model's dtype: (B, length) target log-probs and entropies."""
    logp = torch.log_softmax(model.logits(idx) / temperature, -1)  # (B, T, V)
    ent = -(logp.exp() * logp).sum(-1)  # (B, T)
    pos = start[:, None] + torch.arange(length) - 1  # (B, length) the position before each target
    rows = torch.arange(idx.size(0))[:, None]
    return logp[rows, pos, idx.gather(1, pos + 1)], ent[rows, pos]

def test_logprobs_entropy_match_brute_force_with_chunks_and_grad(monkeypatch):
    torch.manual_seed(0)
    apply, keeps = HeadLogprobs.apply, []  # 7-row chunks: 3 x 20 targets make eight full chunks and a ragged one of 4
    # rest: dtype, entropy, keep (the logits for backward), cut (top_k, top_p)
    monkeypatch.setattr(HeadLogprobs, "apply", lambda h, w, t, temp, rows, *rest: keeps.append(rest[2]) or
                        apply(h, w, t, temp, 7, *rest))
    model = GPT(GPTConfig(block_size=32, vocab_size=60, n_layer=2, n_head=2, n_embd=16)).double()
    idx, start, length = torch.randint(0, 60, (3, 32)), torch.tensor([5, 12, 1]), 20
    a, b = torch.randn(2, 3, length, dtype=torch.float64)
    lp, ent = model(idx, start, length, 0.7, entropy=True)  # through forward, as the trainer calls it
    (a * lp + b * ent).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_lp, ref_ent = brute_logprobs_entropy(model, idx, start, length, 0.7)
    (a * ref_lp + b * ref_ent).sum().backward()
    assert lp.shape == ent.shape == (3, length)
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-10, rtol=0)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-10, rtol=1e-8)
    with torch.no_grad():
        assert torch.equal(model.logprobs(idx, start, length, 0.7), lp)  # entropy=False: one tensor, the same
    model.gradient_checkpointing = True
    model(idx, start, length, 0.7, entropy=True)
    # the logits are kept for backward in the training forward, not without grad nor when checkpointing
    assert keeps == [True, False, False]

def test_logprobs_with_lengths_computes_only_the_positions_that_count():
    """lengths: out and H equal the full pass where j < lengths[b] and are 0 past it, and the gradients are those of
    the full pass with the positions past each row's length weighted 0; a batch where nothing counts gives zeros
    and zero gradients."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=40, vocab_size=70, n_layer=1, n_head=2, n_embd=16)).double()
    idx, start, lengths = torch.randint(0, 70, (3, 40)), torch.tensor([4, 9, 2]), torch.tensor([12, 0, 30])
    keep = torch.arange(30) < lengths[:, None]  # (3, 30)
    w1, w2 = torch.randn(3, 30, dtype=torch.float64), torch.randn(3, 30, dtype=torch.float64)
    grads = []
    for given in (lengths, None):
        model.zero_grad()
        lp, ent = model.logprobs(idx, start, 30, 0.8, entropy=True, lengths=given)
        if given is None:
            lp, ent = lp * keep, ent * keep
        (lp * w1 + ent * w2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if given is not None:
            cut = lp, ent
    torch.testing.assert_close(cut, (lp, ent), atol=1e-12, rtol=0)
    assert torch.all(cut[0][~keep] == 0) and torch.all(cut[1][~keep] == 0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    model.zero_grad()
    lp = model.logprobs(idx, start, 30, lengths=torch.zeros(3, dtype=torch.long))
    lp.sum().backward()
    assert lp.shape == (3, 30) and torch.all(lp == 0) and all(torch.all(p.grad == 0) for p in model.parameters())

def test_logprobs_entropy_are_float32_in_float32():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=60, n_layer=1, n_head=2, n_embd=16))
    idx, start = torch.randint(0, 60, (2, 32)), torch.tensor([3, 9])
    with torch.no_grad():
        lp, ent = model.logprobs(idx, start, 20, entropy=True)
        ref_lp, ref_ent = brute_logprobs_entropy(model, idx, start, 20, 1.0)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (2, 20)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)

def test_forward_with_start_is_the_logprob_path(tiny, reference):
    idx, start = reference["input_ids"], torch.tensor([3, 9])
    with torch.no_grad():
        assert torch.equal(tiny(idx, start, 6, 0.9), tiny.logprobs(idx, start, 6, 0.9))

def test_logprobs_rejects_out_of_range():
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(ValueError, match="start"):
        model.logprobs(torch.zeros(2, 10, dtype=torch.long), torch.tensor([3, 6]), 5)

def test_flops_per_token():
    L, C, V, T = 3, 48, 100, 64
    model = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=4, n_embd=C))
    N = V * C + L * (12 * C * C + 13 * C) + 2 * C  # tied embeddings + blocks + ln_f, without wpe
    assert flops_per_token(model, T) == 6 * N + 12 * L * C * T
    assert flops_per_token(model, T, backward=False) * 3 == flops_per_token(model, T)
    # a training step over 5 rows whose last 16 positions are the completion: the output layer (V x C, 6 FLOPs per
    # weight with backward) runs only on those 16, everything else on all T
    assert update_flops(model, 5, T, 16) == 5 * (T * (6 * (N - V * C) + 12 * L * C * T) + 16 * 6 * V * C)

# -----------------------------------------------------------------------------
# sampler: chi-square goodness of fit on small vocabularies

def expected_probs(logits, temperature, top_k=None, top_p=None):
    """Brute force in float64 with plain Python: softmax, keep the top_k, then the top_p prefix, renormalise."""
    p = [math.exp(x / temperature) for x in logits]
    order = sorted(range(len(p)), key=lambda i: -p[i])[:top_k or len(p)]
    kept, mass, total = [], 0.0, sum(p[i] for i in order)
    for i in order:
        if top_p is not None and mass >= top_p:
            break
        kept.append(i)
        mass += p[i] / total
    z = sum(p[i] for i in kept)
    return [p[i] / z if i in kept else 0.0 for i in range(len(p))]

def chi_square_critical(df, z=3.29):
    """Wilson-Hilferty approximation of the chi-square quantile at normal quantile z (3.29: p = 0.0005)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3

@pytest.mark.parametrize("V", [9, 10])  # two-level blocks of 3 (no tail) and of 4 with a short tail
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, None, None), (1.3, 4, None),
                                                       (1.0, None, 0.6), (0.9, 6, 0.8)])
def test_sampler_chi_square(V, temperature, top_k, top_p):
    # two different distributions in alternating rows: each row must use its own
    dists = [torch.linspace(-2.0, 1.5, V), torch.tensor([0.3 * ((7 * i) % V) for i in range(V)])]
    n = 40000
    logits = torch.stack(dists).repeat(n // 2, 1)  # (n, V)
    tok, lp = sample(logits, temperature, top_k, top_p, torch.rand(n, 2, generator=torch.Generator().manual_seed(1234)))
    for d in range(2):
        probs = expected_probs(dists[d].tolist(), temperature, top_k, top_p)
        counts = torch.bincount(tok[d::2], minlength=V).tolist()
        assert all(c == 0 for c, p in zip(counts, probs) if p == 0), "drew a token the filters removed"
        support = [(c, p * n / 2) for c, p in zip(counts, probs) if p > 0]
        chi2 = sum((c - e) ** 2 / e for c, e in support)
        assert chi2 < chi_square_critical(len(support) - 1), f"distribution {d}: chi2 {chi2:.1f}"
    # the log-prob is under the distribution drawn from: the temperature softmax renormalised over the kept tokens
    q = torch.tensor([expected_probs(dists[d].tolist(), temperature, top_k, top_p) for d in range(2)] * (n // 2))
    torch.testing.assert_close(lp, q.gather(1, tok[:, None]).squeeze(1).log().float())

def test_greedy_sample_is_argmax():
    logits = torch.randn(50, 33, generator=torch.Generator().manual_seed(0))
    tok, lp = sample(logits, temperature=0)
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).max(-1).values)

# -----------------------------------------------------------------------------
# Hugging Face checkpoint I/O

def test_save_load_round_trip_is_exact(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=40, vocab_size=77, n_layer=2, n_head=2, n_embd=16))
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no temp files left behind
    loaded = GPT.from_pretrained(tmp_path)
    assert loaded.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    model.double().save_pretrained(tmp_path / "f64")  # float64 (the trainer's exactness tests) round-trips too
    loaded = GPT.from_pretrained(tmp_path / "f64", dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))

def test_save_reproduces_the_hugging_face_files(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(os.path.join(FIXTURE, "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    config = json.loads((tmp_path / "config.json").read_text())
    with open(os.path.join(FIXTURE, "config.json")) as f:
        hf = json.load(f)
    for key in ["model_type", "architectures", "activation_function", "n_positions", "n_embd", "n_layer", "n_head",
                "vocab_size", "layer_norm_epsilon", "tie_word_embeddings"]:
        assert config[key] == hf[key], key

def test_bias_free_model_saves_zero_biases(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=30, n_layer=1, n_head=2, n_embd=8, bias=False)).eval()
    model.save_pretrained(tmp_path)
    loaded = GPT.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 30, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded.logits(idx), model.logits(idx), atol=1e-6, rtol=0)

def broken_copy(tmp_path, edit_config=None, edit_tensors=None):
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, path)
    if edit_config:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(path / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, path / "model.safetensors")
    return path

@pytest.mark.parametrize("edit_config, edit_tensors, error", [
    (lambda c: c.update(model_type="bert"), None, r"config.json: model_type 'bert' is not supported"),
    (lambda c: c.pop("n_layer"), None, r"config.json: missing key 'n_layer'"),
    (lambda c: c.update(activation_function="relu"), None, r"config.json: unsupported GPT-2 variant"),
    (None, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"),
     r"model.safetensors: missing tensor 'transformer.h.1.mlp.c_fc.bias'"),
    (None, lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(64)}),
     r"model.safetensors: unexpected tensor 'transformer.h.2.ln_1.weight'"),
    (None, lambda t: t.update({"transformer.wpe.weight": torch.zeros(64, 64)}),
     r"model.safetensors: tensor 'transformer.wpe.weight' has shape \(64, 64\), expected \(128, 64\)"),
    (None, lambda t: t.update({"lm_head.weight": torch.zeros(257, 64)}), r"lm_head.weight differs"),
])
def test_bad_checkpoints_fail_clearly(tmp_path, edit_config, edit_tensors, error):
    with pytest.raises(ValueError, match=error):
        GPT.from_pretrained(broken_copy(tmp_path, edit_config, edit_tensors))

def test_missing_files_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        GPT.from_pretrained(tmp_path)
    path = broken_copy(tmp_path)
    os.remove(path / "model.safetensors")
    with pytest.raises(ConfigError, match="model.safetensors not found"):
        GPT.from_pretrained(path)

def test_loads_unprefixed_keys_and_skips_mask_buffers(tmp_path, tiny, reference):
    # the original openai-community/gpt2 files name weights without "transformer." and carry attn.bias buffers
    def unprefix(t):
        for k in list(t):
            t[k.removeprefix("transformer.")] = t.pop(k)
        t["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    model = GPT.from_pretrained(broken_copy(tmp_path, edit_tensors=unprefix)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(reference["input_ids"]), reference["logits"], atol=1e-5, rtol=0)

def test_bf16_autocast_gives_float32_logprobs(tiny):
    # the CUDA recipe is bf16 autocast; CPU autocast exercises the same code: bf16 cache, float32 log-probs
    rows = [p for p in PROMPTS for _ in range(2)]
    with torch.autocast("cpu", torch.bfloat16):
        tokens, _, logps = tiny.generate(PROMPTS, 8, num_samples=2, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([p + t + [0] * (7 - len(p)) for p, t in zip(rows, tokens.tolist())])
    start = torch.tensor([len(p) for p in rows])
    with torch.no_grad():
        ref = tiny.logprobs(idx, start, 8)
        with torch.autocast("cpu", torch.bfloat16):
            lp = tiny.logprobs(idx, start, 8)
    assert logps.dtype == lp.dtype == torch.float32
    torch.testing.assert_close(logps, ref, atol=0.25, rtol=0)
    torch.testing.assert_close(lp, ref, atol=0.25, rtol=0)

def test_bf16_autocast_entropy_is_float32_and_close(tiny, reference):
    # the autocast path of the entropy and its gradient: bf16 matmuls, float32 softmax, a float32 weight gradient
    idx, start = reference["input_ids"], torch.tensor([3, 5])
    model = copy.deepcopy(tiny)  # backward fills .grad: the shared fixture stays as it is
    out = {}
    for name, ctx in [("float32", nullcontext()), ("bf16", torch.autocast("cpu", torch.bfloat16))]:
        model.zero_grad()
        with ctx:
            lp, ent = model.logprobs(idx, start, 10, 0.9, entropy=True)
        (lp - 0.5 * ent).sum().backward()
        out[name] = lp, ent, torch.cat([p.grad.flatten() for p in model.parameters()])
    (lp32, ent32, g32), (lp, ent, g) = out["float32"], out["bf16"]
    assert lp.dtype == ent.dtype == g.dtype == torch.float32
    torch.testing.assert_close(lp, lp32, atol=0.25, rtol=0)
    torch.testing.assert_close(ent, ent32, atol=0.1, rtol=0)
    assert (g - g32).norm() < 0.05 * g32.norm()
