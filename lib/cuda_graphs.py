"""
CUDA graphs for generate's decode steps (train.py's cuda_graphs=True, model.decode_graphs): speed machinery that a
reader of the sampler can skip. engine.py decodes with model.decode; with graphs it decodes with decoder()'s step
instead, which captures the step's kernels once per (rows, attended width, sampling settings, LoRA switches) and
replays them: no Python, dispatch or launch cost per token, which is most of a small model's eager decode step on a
GPU (docs/performance.md).

A graph replays the kernels the step launched at capture, on the addresses it read and wrote then, not the Python
that chose them. Hence: engine.py keeps the KV cache across calls (its static_cache); the step's inputs are copied
into static tensors; the graphs are dropped when the weights move (FSDP gathers them into fresh memory); under
autocast the step reads half-precision copies of the weights (half_weights), since a graph cannot keep autocast's
cache of casts; and the switches a step reads in Python, LoRA's `active` adapters (off when merged or for the
reference), are part of a graph's key. Off CUDA the same code runs with the step called where a graph would replay,
so the CPU tests run this path.
"""
import weakref

import torch


def decoder(model, cache, dtype):
    """A stand-in for model.decode for one generate call, taking the same keyword arguments: it replays the graph
    captured for the call's shapes and settings, capturing it first. cache: engine's static cache of the model, in
    which the graphs, their memory pool and the weight copies are kept."""
    weights = [p.data_ptr() for p in model.parameters()]
    if weights != cache.get("weights"):  # a graph reads the weights where they were at capture
        cache.update(graphs={}, weights=weights, half={})
    if "pool" not in cache:
        cache["pool"] = torch.cuda.graph_pool_handle() if cache["mask"].device.type == "cuda" else None
    dev = cache["mask"].device.type
    autocast = torch.is_autocast_enabled(dev) and dtype != model.lm_head.weight.dtype
    half = half_weights(model, cache, dtype) if autocast else {}
    switches = tuple(m.active for m in model.modules() if hasattr(m, "active"))  # LoRA's adapters on or off
    ref = weakref.ref(model)  # the graphs live in engine's cache, keyed by the model: a strong reference would keep it

    def decode(kv, key_mask, temperature, top_k, top_p, **inputs):
        key = (len(inputs["tok"]), key_mask.shape[1], temperature, top_k, top_p, dtype, switches)
        if key not in cache["graphs"]:
            static = {name: x.clone() for name, x in inputs.items()}  # the inputs every replay reads
            step = lambda: _step(ref(), half, kv=kv, key_mask=key_mask, temperature=temperature, top_k=top_k,
                                 top_p=top_p, **static)
            cache["graphs"][key] = static, _capture(step, cache)
        static, run = cache["graphs"][key]
        for name, x in inputs.items():
            static[name].copy_(x)
        return run()
    return decode


def half_weights(model, cache, dtype):
    """Under autocast, for the graphs: copies in autocast's dtype of the weights and biases of every layer that
    multiplies (not the embeddings, not the norms; the output layer by its own name even when tied to the
    embedding), refreshed from the parameters at each call (the optimizer has changed them) into the same tensors,
    whose addresses the graphs hold. Eagerly, autocast casts each weight once per autocast block and keeps the cast;
    a graph cannot keep that cache, so without these it would cast every weight at every step: read 4 bytes and
    write 2 per parameter before the matmul reads its 2. The copies hold exactly autocast's casts."""
    half = cache.setdefault("half", {})
    if not half or next(iter(half.values())).dtype != dtype:
        half.clear()
        for name, m in model.named_modules():
            own = list(m.named_parameters(recurse=False))
            if not isinstance(m, torch.nn.Embedding) and any(p.dim() == 2 for _, p in own):
                half.update({".".join(filter(None, ("model", name, n))): p.to(dtype) for n, p in own})
        cache["graphs"] = {}  # captured reading other copies
        return half
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, w in half.items():
        w.copy_(params[name[len("model."):]])
    return half


class _Step(torch.nn.Module):
    """functional_call runs a module's forward: this one's is the model's decode step."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model.decode(**inputs)


def _step(model, half, **inputs):
    """model.decode(**inputs), reading the copies in half instead of the parameters of those names."""
    if not half:
        return model.decode(**inputs)
    return torch.func.functional_call(_Step(model), half, (), inputs, tie_weights=False)


def _capture(fn, cache):
    """fn() as a graph: returns run(), which replays fn's kernels and returns its outputs, the same tensors each
    time, overwritten. fn must only read tensors that outlive the graph (the cache, the weights, static inputs). Off
    CUDA run() calls fn and copies its outputs into the first call's, so the CPU tests run this same code path."""
    if cache["pool"] is None:
        out = fn()
        return lambda: [o.copy_(new) for o, new in zip(out, fn())]
    side = torch.cuda.Stream()  # warm-up off the capture stream (lazy initialisations, torch.compile's compile)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # writes the cache column the replay will write again, with the same values
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # autocast's cache of bf16 weight copies lives only as long as the caller's autocast block: the graph must cast
    # the weights itself, into its own memory
    with torch.autocast("cuda", torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"),
                        cache_enabled=False), torch.cuda.graph(graph, pool=cache["pool"]):
        out = fn()

    def run():
        graph.replay()
        return out
    return run
