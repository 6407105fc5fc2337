"""
The CUDA code paths, which CI (no GPU) skips: on a machine with one, `python -m pytest tests/test_cuda.py`
(bench_gpu.sh runs it first). The same properties as the CPU tests, on the GPU's kernels: the fixtures' logits
against what transformers computed, the cached decode against full recomputation, a decode step replayed as a
CUDA graph against the step itself, generate with engine.py's graphs against without, and a Qwen recipe as
written (bf16 autocast, torch.compile, activation checkpointing) with CUDA graphs for two iterations of train.py,
then under FSDP on one GPU, without and with CUDA graphs.
"""
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from model import GPT
from test_families import FAMILIES, FIXTURES
from test_train import ROOT, metrics, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fixture(name):
    path = os.path.join(FIXTURES, name)
    return GPT.from_pretrained(path, dtype=torch.float32, device="cuda").eval(), load_file(
        os.path.join(path, "reference.safetensors"), device="cuda")


@pytest.mark.parametrize("name", ["tiny-gpt2-a"] + FAMILIES)
def test_logits_match_hugging_face_on_cuda(name):
    model, ref = fixture(name)
    with torch.no_grad():
        assert (model.logits(ref["input_ids"]) - ref["logits"]).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_equals_uncached_on_cuda(name):
    model, ref = fixture(name)
    prompts = [ref["greedy_prompt"][0].tolist(), ref["greedy_prompt"][0, :3].tolist()]
    g = torch.Generator("cuda")
    tokens, mask, logps = model.generate(prompts, 12, num_samples=3, generator=g.manual_seed(0))
    want, _, want_lp = model.generate(prompts, 12, plain=True, num_samples=3, generator=g.manual_seed(0))
    assert torch.equal(tokens, want) and mask.all()
    torch.testing.assert_close(logps, want_lp, atol=1e-5, rtol=1e-5)


def test_decode_step_replays_as_a_cuda_graph():
    """The decode step has no host syncs and fixed shapes, so it can be captured once and replayed: the replay must
    give the eager step's tokens and log-probs for new inputs copied into the captured ones."""
    model, _ = fixture("tiny-qwen2-a")
    cfg, n, S = model.config, 8, 64
    kv = [[torch.randn(n, cfg.n_kv_head, S, cfg.head_dim, device="cuda") for _ in "kv"] for _ in range(cfg.n_layer)]
    key_mask = torch.ones(n, S, dtype=torch.bool, device="cuda")
    inputs = dict(tok=torch.randint(0, cfg.vocab_size, (n,), device="cuda"), pos=torch.full((n,), 20, device="cuda"),
                  col=torch.tensor([20], device="cuda"), u=torch.rand(n, 2, device="cuda"))
    step = lambda: model.decode(inputs["tok"], inputs["pos"], kv, inputs["col"], key_mask, inputs["u"], 1.0, None,
                                None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        step()  # warm-up off the capture stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = step()
    for t in range(21, 25):
        fresh = dict(tok=torch.randint(0, cfg.vocab_size, (n,), device="cuda"), pos=torch.full((n,), t, device="cuda"),
                     col=torch.tensor([t], device="cuda"), u=torch.rand(n, 2, device="cuda"))
        for k, v in fresh.items():
            inputs[k].copy_(v)
        graph.replay()
        with torch.no_grad():
            want = step()
        assert torch.equal(out[0], want[0])
        torch.testing.assert_close(out[1], want[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("autocast", [False, True])
def test_generate_with_cuda_graphs_samples_the_same(autocast):
    """engine.py's graphs (model.decode_graphs) against the eager steps, in float32 and under bf16 autocast, over
    two calls (the second replays the first's graphs) and after an in-place weight change (the graphs read it).
    Under autocast no eos: eagerly finished rows are dropped, and a bf16 matmul over fewer rows may round
    differently; with all rows the replayed step (reading engine.half_weights' copies) is the eager one."""
    (model, _), (eager, _) = fixture("tiny-qwen2-a"), fixture("tiny-qwen2-a")  # eager frees its cache: apart
    model.decode_graphs = True
    run = lambda model: model.generate(
        [[5, 17, 200], [1, 2, 3, 4, 5, 6, 7], [42]], 70, num_samples=4, eos_id=None if autocast else 226,
        generator=torch.Generator("cuda").manual_seed(0))
    for change in (False, False, True):
        if change:
            with torch.no_grad():
                model.lm_head.weight.mul_(1.1)
                eager.lm_head.weight.mul_(1.1)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            want, got = run(eager), run(model)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        torch.testing.assert_close(want[2], got[2], atol=1e-5, rtol=0)


def test_qwen_recipe_as_written_on_cuda(tmp_path):
    """bf16 autocast, torch.compile, CUDA graphs and activation checkpointing on the GPU, with the tiny model and
    tokenizer: config/qwen_countdown.py, whose second optimizer step of each rollout is off-policy (the clip is
    live)."""
    fixtures = os.path.join(ROOT, "tests", "fixtures")
    out = tmp_path / "out"
    run(["config/qwen_countdown.py", "--max_iters=2", f"--init_from={fixtures}/tiny-qwen2-a", "--block_size=256",
         f"--tokenizer={fixtures}/tiny-bpe-a", "--eval_interval=2", "--device=cuda", "--cuda_graphs=True",
         "--task=countdown", "--task_options={'count': (3,)}"], out)
    rows = [m for m in metrics(out) if "reward" in m]
    assert [m["iter"] for m in rows] == [0, 1] and all(m["mfu"] > 0 for m in rows)


def test_qwen_recipe_under_fsdp_on_cuda(tmp_path):
    """The same recipe under FSDP on one GPU (torchrun, nccl): rank 0's checkpoint sent by broadcast_from_rank0 into
    the model built on the meta device, FSDP's bf16 mixed precision, torch.compile with FSDP's hooks as graph
    breaks, and a reference model (beta > 0) built sharded on the meta device."""
    fixtures = os.path.join(ROOT, "tests", "fixtures")
    out = tmp_path / "out"
    run(["config/qwen_countdown.py", "--max_iters=2", f"--init_from={fixtures}/tiny-qwen2-a", "--block_size=256",
         f"--tokenizer={fixtures}/tiny-bpe-a", "--eval_interval=2", "--device=cuda", "--parallel=fsdp", "--beta=0.04",
         "--task=countdown", "--task_options={'count': (3,)}"], out,
        launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"))
    rows = [m for m in metrics(out) if "reward" in m]
    assert [m["iter"] for m in rows] == [0, 1] and all(m["mfu"] > 0 and m["kl"] > -1e-6 for m in rows)


def test_cuda_graphs_under_fsdp_on_cuda(tmp_path):
    """cuda_graphs=True under FSDP (eager, to tell its failures from compile's): every generate call gathers the
    weights, perhaps into new memory, which drops the graphs (README, Performance), and the replayed steps run
    inside FSDP's hooks around each block. Evaluations before and after two iterations: four generate calls."""
    fixtures = os.path.join(ROOT, "tests", "fixtures")
    out = tmp_path / "out"
    run(["config/qwen_countdown.py", "--max_iters=2", f"--init_from={fixtures}/tiny-qwen2-a", "--block_size=256",
         f"--tokenizer={fixtures}/tiny-bpe-a", "--eval_interval=2", "--device=cuda", "--parallel=fsdp",
         "--cuda_graphs=True", "--compile=False", "--task=countdown", "--task_options={'count': (3,)}"], out,
        launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"))
    rows = [m for m in metrics(out) if "reward" in m]
    assert [m["iter"] for m in rows] == [0, 1] and all(m["mfu"] > 0 for m in rows)
    assert [m["iter"] for m in metrics(out) if "eval/greedy_acc" in m] == [0, 2]
