"""
Refill (engine.refill, generate's max_rows): at most max_rows rows decode at once, a prompt's G rows
seated as another group leaves. Every completion must be the one generate draws with all rows at
once (max_rows=0) and the one the plain sampler draws (no cache), whatever max_rows and whatever
order the groups end in: in float64, where a batch's composition cannot move a token.
"""
import os
from types import SimpleNamespace

import pytest
import torch

import engine
import rollout
from configurator import ConfigError, check_config, configure
from lib.tokenizer import get_tokenizer
from model import GPT
from test_config import DEFAULTS
from test_multiturn import EOS, Scripted

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
G, STEPS = 4, 40
# ragged, 11 prompts: groups of different lengths leave out of order
LENGTHS = [3, 9, 1, 5, 12, 2, 7, 4, 6, 10, 8]
SAMPLING = [dict(temperature=1.0), dict(temperature=1.0, top_k=20),
            dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=50, top_p=0.8)]


def load(name):
    return GPT.from_pretrained(os.path.join(FIXTURES, name), dtype=torch.float64).eval()


def prompts_of(model):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def ends(model):
    """Eos ids that end a row with about 1/20 chance a step (the fixtures' softmax is nearly flat):
    completions from a token or two to all STEPS."""
    return list(range(0, model.config.vocab_size, 20))


def sample(model, prompts, **kw):
    gens = [torch.Generator().manual_seed(10 + i) for i in range(len(prompts))]
    return model.generate(prompts, STEPS, num_samples=G, eos_id=ends(model), generator=gens, **kw)


def rows_per_step(model):
    """The rows of each decode step, counted by wrapping the instance's decode (no hook in it)."""
    seen, decode = [], model.decode
    model.decode = lambda **kw: (seen.append(len(kw["tok"])), decode(**kw))[1]
    return seen


@pytest.mark.parametrize("fixture, sampling", [("tiny-gpt2-a", SAMPLING),
                                               ("tiny-qwen2-a", SAMPLING[::3]),
                                               ("tiny-gemma3-a", SAMPLING[::3])])
def test_refill_samples_what_all_rows_at_once_and_the_plain_sampler_do(fixture, sampling):
    """Learned positions, rotary with GQA, sliding windows; every max_rows from one group to all;
    temperature, top-k and top-p."""
    model = load(fixture)
    prompts = prompts_of(model)
    for kw in sampling:
        level, plain = sample(model, prompts, **kw), sample(model, prompts, plain=True, **kw)
        lengths = level[1].sum(1)
        assert lengths.min() <= 3 and lengths.max() == STEPS, "the lengths must vary for a test"
        for max_rows in (G, 2 * G, 3 * G, 3 * G + 1, len(prompts) * G):
            seen = rows_per_step(model)
            refilled = sample(model, prompts, max_rows=max_rows, **kw)
            del model.decode
            assert max(seen) <= max_rows
            for a, b, c in zip(refilled, level, plain):
                assert torch.equal(a, b), (kw, max_rows)
                assert torch.equal(a, c), (kw, max_rows)


def test_groups_leave_as_they_end_and_seats_are_refilled():
    """refill yields each group as its last row ends, not in prompt order, and seats the next
    prompt in G rows as soon as G have ended: the batch stays at max_rows rows while prompts
    wait."""
    model = load("tiny-gpt2-a")
    prompts, max_rows = prompts_of(model), 2 * G
    gens = [torch.Generator().manual_seed(10 + i) for i in range(len(prompts))]
    seen = rows_per_step(model)
    with torch.no_grad():
        sampling = dict(temperature=1.0, top_k=None, top_p=None)
        groups = list(engine.refill(model, prompts, STEPS, samples_per_prompt=G,
                                    max_rows=max_rows, sampling=sampling, eos_id=ends(model),
                                    generator=gens, turns=None))
    order = [i for i, *_ in groups]
    assert sorted(order) == list(range(len(prompts))) and order != sorted(order)
    level = sample(model, prompts)
    for i, tokens, mask, logps in groups:
        n = tokens.size(1)
        assert n == int(mask.sum(1).max())  # a group is as long as its longest row
        for a, b in zip((tokens, mask, logps), level):
            assert torch.equal(a, b[i * G:(i + 1) * G, :n])
    # all seats full until the last prompt is seated: the first steps, at least; then the finished
    # rows are dropped
    assert seen[:2 * engine.CHECK_EVERY] == [max_rows] * 2 * engine.CHECK_EVERY
    assert min(seen) < max_rows


def test_refill_without_eos_and_greedy():
    """Every row decoding all the steps (no eos), and greedy: the same as all rows at once."""
    model = load("tiny-qwen2-a")
    prompts = prompts_of(model)
    for kw in (dict(eos_id=None), dict(temperature=0.0, eos_id=ends(model))):
        gen = torch.Generator().manual_seed(3)  # one generator for all rows
        args = dict(num_samples=G, **kw)
        level = model.generate(prompts, STEPS, generator=gen, **args)
        gen = torch.Generator().manual_seed(3)
        refilled = model.generate(prompts, STEPS, generator=gen, max_rows=3 * G, **args)
        for a, b in zip(refilled, level):
            assert torch.equal(a, b), kw


def test_multi_turn_rows_refill_the_same():
    """A row that reads observations goes ahead of the others; seated late, it samples the same,
    and its environment sees the same calls."""
    model = load("tiny-gpt2-a")
    prompts = prompts_of(model)
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    run = lambda env, **kw: model.generate(prompts, 60, num_samples=G, temperature=0.9, eos_id=EOS,
                                           generator=gens(), turns=env, **kw)
    env, refill_env = Scripted(), Scripted()
    level, refilled = run(env), run(refill_env, max_rows=2 * G)
    assert env.calls, "no row ended a turn: the test would prove nothing"
    for a, b in zip(refilled, level):
        assert torch.equal(a, b)
    assert sorted(refill_env.calls) == sorted(env.calls)


def test_refill_with_decode_graphs():
    """model.decode_graphs (on the CPU its step is called where a CUDA graph replays): a graph per
    rows and width, the cache kept across calls; the same samples."""
    model = load("tiny-gpt2-a")
    prompts = prompts_of(model)
    eager = sample(model, prompts, max_rows=2 * G)
    model.decode_graphs = True
    try:
        for max_rows in (2 * G, 3 * G):  # the second call reuses the first's cache, grown
            for a, b in zip(sample(model, prompts, max_rows=max_rows), eager):
                assert torch.equal(a, b)
    finally:
        model.decode_graphs = False
        engine._CACHES.pop(model, None)


def test_the_rollout_samples_with_the_run_s_max_rows():
    """train.py's max_rows reaches the sampler through rollout.sample: no step decodes more rows,
    and the rollout is the one all rows at once give."""
    model, enc = load("tiny-gpt2-a"), get_tokenizer("bytes")
    rows = [{"prompt": f"{a}+{a * 7 % 10}="} for a in range(6)]
    cfg = lambda max_rows: SimpleNamespace(
        max_rows=max_rows, num_generations=G, max_completion_length=STEPS, temperature=1.0,
        top_k=None, top_p=None, eos_ids=ends(model), lora_rank=0, autocast=False,
        ptdtype=torch.float64, environment=None, tool_workers=1, plain=False, template=None)
    level = rollout.sample(model, rows, range(6), cfg(0), enc)[1:4]
    seen = rows_per_step(model)
    refilled = rollout.sample(model, rows, range(6), cfg(2 * G), enc)[1:4]
    assert max(seen) == 2 * G
    for a, b in zip(refilled, level):
        assert torch.equal(a, b)


def test_max_rows_below_a_group_is_refused():
    model = load("tiny-gpt2-a")
    with pytest.raises(ValueError, match=r"^max_rows=3 holds no group of num_samples=4 rows: make "
                                         r"it >= 4, or 0 for all rows at once$"):
        sample(model, prompts_of(model), max_rows=3)
    for max_rows in (-1, 3):
        c = configure(DEFAULTS, [f"--max_rows={max_rows}", "--num_generations=4"])
        message = rf"^max_rows={max_rows} must be 0 \(all rows at once\) or >= num_generations=4"
        with pytest.raises(ConfigError, match=message):
            check_config(c, 1)
