"""
Tests for docs/lessons.md and its solutions in docs/solutions/: each patch is applied to a fresh copy of the
repository's .py files in a temporary directory and the patched code is imported or run from there, each module is
imported, and the new behaviour is checked against an independent brute-force reference, so the solutions keep
working as the code moves. Also: the reading path's links resolve, the names it cites exist, and the code it
quotes is still in the source.

LESSONS_CHECK=mine runs the exercise checks on the working tree as it is instead (a student's own answers to
exercises 1-3 and 6-8: loss.py, length_penalty.py at the repository root, data.py); exercise 5's
checks then skip.
"""
import importlib.util
import itertools
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from reward import compute_rewards, exact_match, get_reward_fns  # noqa: E402
from lib.tokenizer import get_tokenizer  # noqa: E402
import test_curriculum  # noqa: E402

DOCS = os.path.join(ROOT, "docs")
SOLUTIONS = os.path.join(DOCS, "solutions")
MINE = os.environ.get("LESSONS_CHECK") == "mine"
# the others change too often to patch against
PATCHABLE = {"loss.py", "rollout.py", "reward.py", "data.py", "lib/curriculum.py"}
DT = torch.float64
NAN = float("nan")
_names = itertools.count()


def copy_repo(directory):
    """The repository's top-level .py files, lib/ (and tests/multi_run.py) copied into directory."""
    os.makedirs(os.path.join(directory, "tests"), exist_ok=True)
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), directory)
    shutil.copytree(os.path.join(ROOT, "lib"), os.path.join(directory, "lib"), ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "tests", "multi_run.py"), os.path.join(directory, "tests"))
    return str(directory)


def apply(patch, directory):
    """Apply docs/solutions/<patch> in directory with git apply: exactly, without patch(1)'s fuzz, so that a lesson
    whose code has moved on fails here instead of applying somewhere near."""
    path = os.path.join(SOLUTIONS, patch)
    with open(path) as f:
        touched = set(re.findall(r"^\+\+\+ b/(\S+)", f.read(), re.MULTILINE))
    assert touched and touched <= PATCHABLE, f"{patch} touches {sorted(touched)}; solutions patch only {PATCHABLE}"
    if not shutil.which("git"):
        pytest.skip("git is not installed")
    p = subprocess.run(["git", "apply", "-p1", path], cwd=directory, capture_output=True, text=True)
    assert p.returncode == 0, f"{patch} no longer applies to the current code:\n{p.stdout}{p.stderr}"
    return directory


def unapply(patch, directory):
    """Take docs/solutions/<patch> out of directory again (git apply -R): a patch that removes an exercise's
    answer, reversed, is the answer."""
    p = subprocess.run(["git", "apply", "-R", "-p1", os.path.join(SOLUTIONS, patch)], cwd=directory,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(MINE, reason="your working tree holds your own answers, which the solutions need not fit")
def test_every_solution_applies_exactly():
    """git apply --check on the repository itself: every patch of docs/solutions/, with no fuzz. One test, named
    after no exercise, so that an exercise's `-k` check never selects it."""
    if not shutil.which("git"):
        pytest.skip("git is not installed")
    failed = {}
    for patch in sorted(p for p in os.listdir(SOLUTIONS) if p.endswith(".patch")):
        p = subprocess.run(["git", "apply", "--check", "-p1", os.path.join(SOLUTIONS, patch)], cwd=ROOT,
                           capture_output=True, text=True)
        if p.returncode != 0:
            failed[patch] = p.stderr
    assert not failed, f"no longer apply to the current code: {failed}"


def solved(tmp_path, patch):
    """Where the code to check lives: the working tree (LESSONS_CHECK=mine), else a copy with the solution applied."""
    if MINE:
        return ROOT
    directory = copy_repo(tmp_path / "solved")
    apply(patch, directory)
    return directory


def load(directory, name):
    """directory/name.py as a module of its own, which never replaces the repository's module of that name (its own
    imports, e.g. data.py's `from reward import`, resolve as usual)."""
    path = os.path.join(directory, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"lesson_{name}_{next(_names)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_train(directory, args, out_dir):
    """python train.py ARGS in directory (a tiny float64 model, one process); returns (stdout, metrics lines)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "train.py", *TINY, *args, f"--out_dir={out_dir}"], cwd=directory, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return p.stdout, [json.loads(line) for line in f]


TINY = ["--dtype=float64", "--save_interval=0", "--prompts_per_step=4", "--num_generations=4", "--block_size=32",
        "--micro_batch_size=16", "--sft_iters=0", "--max_iters=1", "--n_layer=1", "--n_head=2", "--n_embd=16",
        "--peak_flops=1e12"]


# ----------------------------------------------------------------------------------------------------------------
# exercise 1: a median baseline in loss.group_advantages

def brute_median_advantages(rewards, G, scale):
    """A loop with the statistics module: R_i - median of the group's valid rewards, divided by the group's or the
    batch's sample std + 1e-4 (or not); NaN rewards get 0 and stay out of every statistic."""
    rewards = rewards.tolist()
    valid_all = [x for x in rewards if not math.isnan(x)]
    batch_std = statistics.stdev(valid_all) if len(valid_all) > 1 else 0.0
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        valid = [x for x in group if not math.isnan(x)]
        std = statistics.stdev(valid) if len(valid) > 1 else 0.0
        divisor = {"group": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        out += [0.0 if math.isnan(x) else (x - statistics.median(valid)) / divisor for x in group]
    return torch.tensor(out, dtype=DT)


@pytest.fixture(scope="module")
def median_loss(tmp_path_factory):
    return load(solved(tmp_path_factory.mktemp("median"), "median_baseline.patch"), "loss")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 5])
def test_median_baseline_matches_a_loop(median_loss, G, scale):
    rng = random.Random(G)
    for _ in range(5):
        rewards = [rng.choice([0.0, 1.0, 0.5, rng.uniform(-3, 3), NAN]) for _ in range(6 * G)]
        rewards[:G] = [NAN] * G  # a group no reward applies to
        rewards = torch.tensor(rewards, dtype=DT)
        got = median_loss.group_advantages(rewards, G, scale, "median")
        torch.testing.assert_close(got, brute_median_advantages(rewards, G, scale), rtol=1e-12, atol=1e-12)


def test_median_baseline_by_hand(median_loss):
    ga = median_loss.group_advantages
    assert ga(torch.tensor([0.0, 1, 3, 10]), 4, "none", "median").tolist() == [-2, -1, 1, 8]  # even: middle two
    assert ga(torch.tensor([1.0, 2, 3, 100]), 4, "none", "median").tolist() == [-1.5, -0.5, 0.5, 97.5]
    assert (ga(torch.tensor([1.0, 2, 3, 100]), 4, "none", "grpo")[:3] < 0).all()  # the mean: the outlier wins
    # 0/1 rewards, mostly right: the median is the majority, so the right answers get 0, the wrong one -1
    assert ga(torch.tensor([1.0, 1, 1, 0]), 4, "none", "median").tolist() == [0, 0, 0, -1]
    assert ga(torch.tensor([NAN, 5.0, 1, NAN]), 4, "none", "median").tolist() == [0, 2, -2, 0]


def test_median_patch_leaves_the_other_estimators_alone(median_loss):
    import loss
    g = torch.Generator().manual_seed(0)
    rewards = torch.where(torch.rand(24, generator=g) < 0.2, NAN, torch.randn(24, generator=g, dtype=DT))
    for estimator, scales in (("grpo", "group batch none"), ("rloo", "group batch none"), ("reinforce_pp", "none")):
        for scale in scales.split():
            assert torch.equal(median_loss.group_advantages(rewards, 4, scale, estimator),
                               loss.group_advantages(rewards, 4, scale, estimator)), (estimator, scale)
    with pytest.raises(ValueError, match="median"):  # the error lists it among the valid names
        median_loss.group_advantages(rewards, 4, "none", "mode")


# ----------------------------------------------------------------------------------------------------------------
# exercise 2: a length penalty with reward.py's interface

@pytest.fixture
def length_penalty(monkeypatch):
    monkeypatch.syspath_prepend(ROOT if MINE else SOLUTIONS)
    monkeypatch.delitem(sys.modules, "length_penalty", raising=False)
    (fn,) = get_reward_fns("length_penalty:length_penalty")
    return fn


def test_length_penalty_through_get_reward_fns(length_penalty):
    got = length_penalty(["p"] * 3, ["a", "abcd", "abcdefgh"], completion_ids=[[1], [1, 2, 3, 4], list(range(8))],
                         max_completion_length=8, answer=["x"] * 3, truncated=[False, False, True])
    assert got == [-0.125, -0.5, -1.0]


def test_length_penalty_orders_equally_right_answers_only(length_penalty):
    completions = ["85", "85", "7", "7"]  # right short, right long, wrong short, wrong long (in tokens)
    lengths = [2, 12, 1, 16]
    columns = dict(answer=["85"] * 4, completion_ids=[[0] * n for n in lengths], max_completion_length=16,
                   truncated=[False] * 3 + [True])
    total, per_fn = compute_rewards([exact_match, length_penalty], [1.0, 0.1], ["47+38="] * 4, completions, columns)
    assert per_fn["length_penalty"] == [-n / 16 for n in lengths]
    assert total[0] > total[1] > 0 > total[2] > total[3]  # a right answer beats any wrong one; short beats long


def test_length_penalty_in_the_rollout(length_penalty):
    """rollout.score passes it what a real rollout does: the sampled ids up to the mask's end, eos included."""
    import rollout
    enc = get_tokenizer("bytes")
    eos, C = enc.eot_token, 6
    cfg = SimpleNamespace(num_generations=2, max_completion_length=C, eos_ids=[eos])
    rows = [{"prompt": "1+1=", "answer": "2"}]
    tokens = torch.tensor([[ord("2"), eos, eos, eos, eos, eos], [ord("1"), ord("1"), ord("1"), ord("1"), ord("1"),
                                                                 ord("1")]])
    mask = torch.tensor([[True, True, False, False, False, False], [True] * 6])  # an answer + eos, a truncated one
    rewards, truncated, texts, per_fn = rollout.score(rows, tokens, mask, cfg, enc, [exact_match, length_penalty],
                                                      [1.0, 0.1])
    assert texts == ["2", "111111"] and truncated.tolist() == [False, True]
    assert per_fn["length_penalty"] == [-2 / C, -1.0]
    torch.testing.assert_close(rewards, torch.tensor([1 - 0.1 * 2 / C, -0.1], dtype=DT))


# ----------------------------------------------------------------------------------------------------------------
# exercise 3: a built-in task, reversing a word

@pytest.fixture(scope="module")
def reverse_dir(tmp_path_factory):
    return solved(tmp_path_factory.mktemp("reverse"), "reverse_task.patch")


def test_reverse_rows_verify_with_their_reward(reverse_dir):
    data = load(reverse_dir, "data")
    rows = data.load_dataset("reverse", "train", seed=3, size=300)
    assert len(rows) == 300 and len({r["prompt"] for r in rows}) == 300
    words = [re.fullmatch(r"reverse ([a-z]{4}):", r["prompt"]).group(1) for r in rows]
    assert [r["answer"] for r in rows] == ["".join(reversed(w)) for w in words]
    names, weights = data.default_reward("reverse", rows)
    (fn,) = get_reward_fns(names)
    prompts = [r["prompt"] for r in rows]
    assert fn(prompts, [f" {r['answer']}\n" for r in rows], answer=[r["answer"] for r in rows]) == [1.0] * 300
    wrong = [(w, r["answer"]) for w, r in zip(words, rows) if w != r["answer"]]  # palindromes aside
    assert fn([""] * len(wrong), [w for w, _ in wrong], answer=[a for _, a in wrong]) == [0.0] * len(wrong)


def test_reverse_splits_and_options(reverse_dir):
    data = load(reverse_dir, "data")
    train = {r["prompt"] for r in data.load_dataset("reverse", "train", size=10_000, length=2)}
    test = {r["prompt"] for r in data.load_dataset("reverse", "test", size=10_000, length=2)}
    every = {f"reverse {a}{b}:" for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"}
    assert not train & test and train | test == every  # each of the 676 words once, in one split
    assert all(data.split_of(p) == "test" for p in test)
    for bad, message in (({"letters": 3}, "has no option 'letters'"), ({"length": 0}, "must be a positive integer")):
        with pytest.raises(ValueError, match=message):
            data.load_dataset("reverse", "train", **bad)


def test_reverse_task_trains_end_to_end(reverse_dir, tmp_path):
    out, metrics = run_train(reverse_dir, ["--task=reverse", "--eval_interval=1", "--eval_size=4",
                                           "--max_completion_length=6"], tmp_path / "out")
    assert re.search(r"'reverse [a-z]{4}:' -> ", out), out  # the evaluation's samples are the new task's
    assert {"eval/greedy_acc", "reward/exact_match"} <= {k for m in metrics for k in m}


# ----------------------------------------------------------------------------------------------------------------
# exercise 4: where the KL goes (no code change: the predictions, checked with the project's functions)

@pytest.fixture(scope="module")
def kl():
    return load(SOLUTIONS, "kl_placement")


def test_kl_placement_in_the_loss_leaves_the_advantages_alone(kl):
    import loss
    rewards, logps, ref, mask = kl.example_group()
    for scale in ("none", "group"):
        plain = loss.group_advantages(rewards, 4, scale)
        for beta in (0.004, 0.04, 0.4):
            assert torch.equal(kl.advantages(rewards, logps, ref, mask, beta, False, scale), plain)


def test_kl_placement_in_the_reward_shifts_each_advantage(kl):
    rewards, logps, ref, mask = kl.example_group()
    x = (ref - logps).tolist()  # log(pi_ref / pi)
    k3 = [sum(math.exp(x[i][t]) - x[i][t] - 1 for t in range(3) if mask[i, t]) for i in range(4)]  # by hand
    shift = kl.advantages(rewards, logps, ref, mask, kl.BETA, True, "none") - \
        kl.advantages(rewards, logps, ref, mask, kl.BETA, False, "none")
    torch.testing.assert_close(shift, torch.tensor([-kl.BETA * (k - statistics.mean(k3)) for k in k3], dtype=DT),
                               rtol=1e-10, atol=1e-14)
    assert abs(shift.sum().item()) < 1e-14 and shift.abs().max() > 1e-3


def test_kl_placement_flat_group_gets_unit_size_advantages_from_kl_noise(kl):
    _, logps, ref, mask = kl.example_group()
    flat = torch.ones(4, dtype=DT)
    k = kl.sequence_kl(logps, ref, mask)
    assert torch.equal(kl.advantages(flat, logps, ref, mask, kl.BETA, False, "group"), torch.zeros(4, dtype=DT))
    got = {}
    for beta in (kl.BETA, kl.BETA / 10):  # -(K_i - mean K) / (std K + 1e-4 / beta): beta cancels but for the 1e-4
        got[beta] = kl.advantages(flat, logps, ref, mask, beta, True, "group")
        torch.testing.assert_close(got[beta], -(k - k.mean()) / (k.std() + 1e-4 / beta), rtol=1e-10, atol=1e-14)
    assert got[kl.BETA].abs().max() > 1.0  # as large as a right/wrong signal, from KL noise alone
    torch.testing.assert_close(got[kl.BETA / 10], got[kl.BETA], rtol=0.1, atol=0)  # beta 10x smaller: ~the same


def test_kl_placement_gradient_per_token(kl):
    rewards, logps, ref, mask = kl.example_group()
    n = mask.sum().item()  # dapo: the step's valid tokens
    adv = kl.advantages(rewards, logps, ref, mask, kl.BETA, False, "none")
    # beta in the loss: -A_i / N from the surrogate (r = 1, dr/dlogp = 1) plus beta (1 - pi_ref / pi) / N, per token
    want = (-adv[:, None] + kl.BETA * (1 - torch.exp(ref - logps))) / n
    got = kl.gradient(rewards, logps, ref, mask, kl.BETA, False, "none")
    torch.testing.assert_close(got, torch.where(mask, want, 0.0), rtol=1e-10, atol=1e-14)
    assert got[3, 0] > got[3, 1:].max()  # the token that left the reference most is pushed back hardest
    # the KL in the reward: every token of a completion gets the same -A'_i / N
    shaped = kl.advantages(rewards, logps, ref, mask, kl.BETA, True, "none")
    got = kl.gradient(rewards, logps, ref, mask, kl.BETA, True, "none")
    torch.testing.assert_close(got, torch.where(mask, -shaped[:, None] / n, 0.0), rtol=1e-10, atol=1e-14)


# ----------------------------------------------------------------------------------------------------------------
# exercise 5: break split invariance on purpose; the check must fail with the patch and pass without it

mine_skip = pytest.mark.skipif(MINE, reason="your break is checked by tests/test_loss.py -k split_invariance")


def split_gap(loss, micro_batches):
    """max |gradient of the whole step - sum of the micro-batches' gradients| through loss.grpo_loss, dapo, each
    micro-batch given the step's num_sequences and num_tokens as train.py gives them."""
    g = torch.Generator().manual_seed(5)
    B, T = 8, 6
    lengths = torch.tensor([6, 1, 5, 2, 6, 3, 4, 2])
    mask = torch.arange(T) < lengths[:, None]
    logps = -2 * torch.rand(B, T, generator=g, dtype=DT)
    old = torch.where(mask, logps + 0.2 * torch.randn(B, T, generator=g, dtype=DT), 0.0)
    adv = torch.randn(B, generator=g, dtype=DT)

    def grad(rows, **counts):
        leaf = logps[rows].clone().requires_grad_(True)
        loss.grpo_loss(leaf, old[rows], None, adv[rows], mask[rows], loss_type="dapo", **counts)[0].backward()
        return leaf.grad
    whole = grad(torch.arange(B))
    summed = torch.zeros_like(logps)
    for rows in torch.argsort(lengths, stable=True).chunk(micro_batches):  # sorted by length, as the trainer does
        summed[rows] = grad(rows, num_sequences=B, num_tokens=mask.sum())
    return (summed - whole).abs().max().item()


@mine_skip
def test_per_micro_batch_tokens_breaks_split_invariance(tmp_path):
    import loss
    broken = load(solved(tmp_path, "per_micro_batch_tokens.patch"), "loss")
    assert split_gap(loss, 1) < 1e-15 and split_gap(broken, 1) < 1e-15  # one micro-batch: the bug is invisible
    for k in (2, 4):
        assert split_gap(loss, k) < 1e-15, k
        assert split_gap(broken, k) > 1e-3, k


@mine_skip
def test_per_micro_batch_tokens_is_caught_by_train_py(tmp_path):
    """test_exact.py in small: one iteration with 1 micro-batch and with 4 leaves the same weights, until the patch."""
    from safetensors.torch import load_file
    dirs = {"as is": copy_repo(tmp_path / "as_is"), "broken": solved(tmp_path, "per_micro_batch_tokens.patch")}
    args = TINY + ["--eval_interval=0", "--block_size=16", "--max_completion_length=4", "--learning_rate=1e-2",
                   "--task_options={'digits': 1}", "--loss_type=dapo", "--reward_funcs=('exact_match', 'overlong')"]
    procs = {}
    for name, directory in dirs.items():  # both at once: each is mostly torch's start-up
        runs = [args + [f"--micro_batch_size={m}", f"--out_dir={directory}/out{m}"] for m in (4, 16)]
        with open(os.path.join(directory, "runs.json"), "w") as f:
            json.dump(runs, f)
        procs[name] = subprocess.Popen([sys.executable, os.path.join("tests", "multi_run.py"), "runs.json"],
                                       cwd=directory, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, (name, out[-3000:])

    def weights(name, m):
        out = os.path.join(dirs[name], f"out{m}")
        with open(os.path.join(out, "latest")) as f:
            return load_file(os.path.join(out, json.load(f), "model.safetensors"))

    def gap(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in a)
    assert gap(weights("as is", 4), weights("as is", 16)) <= 1e-10  # split invariant
    assert gap(weights("broken", 16), weights("as is", 16)) <= 1e-10  # one micro-batch: the same step
    assert gap(weights("broken", 4), weights("broken", 16)) > 1e-6  # four: not any more


# --------------------------------------------------------------------------------------------------
# exercise 8: the reverse-KL advantage. Its solution is loss.py as it is: the exercise's patch
# removes the body, so the checks read the working tree either way (with LESSONS_CHECK=mine, a
# student's own body).

@pytest.fixture(scope="module")
def distill_advantages():
    return load(ROOT, "loss").reverse_kl_advantages


@pytest.mark.parametrize("discount", [0.0, 0.3, 1.0])
def test_distill_advantages_match_a_loop(distill_advantages, discount):
    from test_distill import loop_advantages
    g = torch.Generator().manual_seed(6)
    mask = torch.rand(5, 9, generator=g) < 0.6
    mask[2], mask[3, 4:] = False, True  # a row with no counted token, one with a run of them
    # holes hold what no sample of the student's would: infinities too, which a product by the
    # mask makes NaN
    logps = torch.where(mask, -3 * torch.rand(5, 9, generator=g, dtype=DT), -math.inf)
    teacher = torch.where(mask, -3 * torch.rand(5, 9, generator=g, dtype=DT), math.inf)
    got = distill_advantages(logps, teacher, mask, discount)
    want = loop_advantages(logps, teacher, mask, discount)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_distill_advantages_give_minus_the_kl_s_gradient(distill_advantages):
    from test_distill import reverse_kl_gradients
    for discount, (got, want) in reverse_kl_gradients(distill_advantages, "dr_grpo").items():
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"discount={discount}")


@mine_skip
def test_the_eighth_exercise_starts_from_an_empty_body(tmp_path):
    """The exercise's patch leaves the docstring alone: the function returns None and the
    page's check fails, on this exercise's tests."""
    directory = student_copy(tmp_path / "student")
    apply("reverse_kl_exercise.patch", directory)
    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    assert load(directory, "loss").reverse_kl_advantages(zeros, zeros, mask) is None
    code, ran, out = run_check(directory, checks()["distill"])
    ours = all(t.startswith("tests/test_lessons.py::test_distill_") for t in ran)
    assert code == 1 and ran and ours, out


# ----------------------------------------------------------------------------------------------------------------
# the lesson page itself

def lessons():
    with open(os.path.join(DOCS, "lessons.md")) as f:
        return f.read()


OTHERS_PAGES = {"advantages.md", "kl.md", "normalisers.md", "on_policy.md", "sampler.md", "surrogates.md"}


def test_lessons_links_resolve_and_every_solution_is_linked():
    linked = set()
    for page in ["lessons.md"] + [f"solutions/{f}" for f in os.listdir(SOLUTIONS) if f.endswith(".md")]:
        with open(os.path.join(DOCS, page)) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" in target or page == "lessons.md" and target in OTHERS_PAGES:  # those pages are not ours
                continue
            path = os.path.normpath(os.path.join(DOCS, os.path.dirname(page), target))
            assert os.path.exists(path), (page, target)
            linked.add(path)
    for name in os.listdir(SOLUTIONS):
        if not name.startswith(".") and name != "__pycache__":
            assert os.path.join(SOLUTIONS, name) in linked, f"docs/solutions/{name} is linked from no page"


def test_lessons_cite_names_that_exist():
    """Every `module.name` (or `module.Class.method`) the page cites is defined in that module's file."""
    cited = re.findall(r"`(loss|rollout|train|reward|data|model|configurator)\.(\w+)(?:\.(\w+))?`", lessons())
    assert len(cited) > 15
    for module, name, attr in cited:
        with open(os.path.join(ROOT, f"{module}.py")) as f:
            source = f.read()
        for n in filter(None, (name, attr) if name != "py" else ()):  # `reward.py` is a file, not a name
            assert re.search(rf"^\s*(def|class) {n}\b|^\s*{n} = ", source, re.MULTILINE), f"{module}.{name}.{attr}"


def test_lessons_quote_code_that_is_in_the_source():
    """The reading path quotes code verbatim: each code span of Part 1 with ( ) [ ] = or * is in some .py file."""
    part1 = lessons().split("## Part 1")[1].split("## Part 2")[0]
    source = ""
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            with open(os.path.join(ROOT, name)) as f:
                source += f.read()
    quoted = [span for span in re.findall(r"`([^`\n]+)`", part1.replace("\n", " ")) if re.search(r"[()\[\]=*]", span)]
    assert len(quoted) > 15
    missing = [span for span in quoted if span not in source]
    assert not missing, f"quoted in docs/lessons.md but no longer in the code: {missing}"


# ----------------------------------------------------------------------------------------------------------------
# each exercise's documented check, run as the page says, on a right answer and on a wrong one

def wrong(path, right, bad):
    """Make the answer in `path` wrong: its text `right` becomes `bad`."""
    with open(path) as f:
        text = f.read()
    assert right in text, (path, right)
    with open(path, "w") as f:
        f.write(text.replace(right, bad))


# keyword of the page's `-k` check: how to give the right answer in a copy of the repository, how to spoil it
ANSWERS = {
    "median": (lambda d: apply("median_baseline.patch", d),
               lambda d: wrong(os.path.join(d, "loss.py"), "[(n - 1) // 2, n // 2]", "[n // 2, n // 2]")),
    "length_penalty": (lambda d: shutil.copy(os.path.join(SOLUTIONS, "length_penalty.py"), d),
                       lambda d: wrong(os.path.join(d, "length_penalty.py"), "len(ids) / max_completion_length "
                                       "for ids in completion_ids", "len(c) / max_completion_length for c in "
                                       "completions")),
    "reverse": (lambda d: apply("reverse_task.patch", d),
                lambda d: wrong(os.path.join(d, "data.py"), '"answer": word[::-1]', '"answer": word')),
    "pass_rate": (lambda d: unapply("pass_rate_pool.patch", apply("pass_rate_pool.patch", d)),
                  lambda d: wrong(os.path.join(d, "lib", "curriculum.py"), "streak = 0\n", "pass\n")),
    # the code as it is holds the answer; the exercise's start (the patch: its lines out) fails
    "stale": (lambda d: None, lambda d: apply("decoupled_removed.patch", d)),
    # the code as it is answers exercise 8; the spoilt one has the gap's sign the wrong way round
    "distill": (lambda d: None,
                lambda d: wrong(os.path.join(d, "loss.py"), "teacher_logps - logps",
                                "logps - teacher_logps")),
}


def checks():
    """The `LESSONS_CHECK=mine python -m pytest ...` commands of docs/lessons.md, by their -k keyword."""
    found = re.findall(r"`LESSONS_CHECK=mine (python -m pytest tests/test_lessons.py -k (\w+))`", lessons())
    return {keyword: command for command, keyword in found}


def test_every_exercise_check_is_tested():
    assert sorted(checks()) == sorted(ANSWERS)


def run_check(directory, command):
    """The page's command, as a student types it, in directory; (exit code, the test ids it ran, output)."""
    env = dict(os.environ, LESSONS_CHECK="mine", OMP_NUM_THREADS="1")
    python, *args = command.split()  # the python of this environment, as a student's venv's
    assert python == "python", command
    p = subprocess.run([sys.executable, *args, "-rA", "-p", "no:cacheprovider"], cwd=directory, env=env,
                       capture_output=True, text=True, timeout=600)
    ran = re.findall(r"^(?:PASSED|FAILED|ERROR|SKIPPED) (\S+)", p.stdout, re.MULTILINE)
    return p.returncode, ran, p.stdout[-3000:] + p.stderr[-3000:]


def student_copy(directory):
    """What a student's clone holds for the checks: the code, the tests, pytest.ini, the page and its solutions."""
    directory = copy_repo(directory)
    for name in os.listdir(os.path.join(ROOT, "tests")):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, "tests", name), os.path.join(directory, "tests"))
    shutil.copy(os.path.join(ROOT, "pytest.ini"), directory)
    shutil.copytree(SOLUTIONS, os.path.join(directory, "docs", "solutions"))
    shutil.copy(os.path.join(DOCS, "lessons.md"), os.path.join(directory, "docs"))
    return directory


@mine_skip
@pytest.mark.parametrize("keyword", ["median", "length_penalty", "reverse", "pass_rate", "stale", "distill"],
                         ids=["ex1", "ex2", "ex3", "ex6", "ex7", "ex8"])
def test_an_exercise_check_passes_a_right_answer_and_fails_a_wrong_one(keyword, tmp_path):
    """Apply the solution, run the page's check: it passes, having run this exercise's tests alone; spoil the
    answer: it fails."""
    directory = student_copy(tmp_path / "student")
    right, spoil = ANSWERS[keyword]
    right(directory)
    code, ran, out = run_check(directory, checks()[keyword])
    assert code == 0 and ran, out
    assert all(t.startswith(f"tests/test_lessons.py::test_{keyword}_") for t in ran), ran  # its own tests only
    spoil(directory)
    code, _, out = run_check(directory, checks()[keyword])
    assert code == 1 and " failed" in out, out


@mine_skip
def test_the_break_exercise_check_fails_on_the_break(tmp_path):
    """Exercise 5's check, run as the page says on its break (the solution): it fails, on split invariance tests."""
    command = re.search(r"`(python -m pytest tests/test_loss.py -k split_invariance)` should now fail", lessons())
    directory = student_copy(tmp_path / "student")
    apply("per_micro_batch_tokens.patch", directory)
    code, ran, out = run_check(directory, command.group(1))
    assert code == 1 and ran and all("split_invariance" in t for t in ran), out


# ----------------------------------------------------------------------------------------------------------------
# exercise 6: the curriculum's pass-rate pool (lib/curriculum.py: Pool.retired and Pool.visit)

@pytest.fixture(scope="module")
def pool_class(tmp_path_factory):
    """The Pool to check: the working tree's (LESSONS_CHECK=mine), else the solution: the repository's own code,
    the lines pass_rate_pool.patch removes, put back."""
    directory = ROOT if MINE else copy_repo(tmp_path_factory.mktemp("pool"))
    return load(os.path.join(directory, "lib"), "curriculum").Pool


def test_pass_rate_by_hand(pool_class):
    test_curriculum.test_the_pass_rate_and_streak_by_hand(pool_class)


def test_pass_rate_retires_and_brings_back(pool_class):
    test_curriculum.test_a_retired_prompt_is_passed_rest_times_then_visits_once(pool_class)


def test_pass_rate_against_a_loop(pool_class):
    test_curriculum.test_the_pool_brute_force(pool_class)


@mine_skip
def test_the_pool_patch_takes_out_the_answer(tmp_path):
    """The exercise's start: with the patch applied every pool check fails."""
    blank = load(os.path.join(apply("pass_rate_pool.patch", copy_repo(tmp_path)), "lib"), "curriculum").Pool
    for check in (test_curriculum.test_the_pass_rate_and_streak_by_hand,
                  test_curriculum.test_a_retired_prompt_is_passed_rest_times_then_visits_once,
                  test_curriculum.test_the_pool_brute_force):
        with pytest.raises(AssertionError):
            check(blank)


# ----------------------------------------------------------------------------------------------------------------
# exercise 7: the objective of stale groups (loss.decoupled_loss), written back

def brute_decoupled(logps, prox, behav, A, mask, eps, clip_max, mode):
    """AReaL's decoupled PPO by a loop over tokens, from its equation:
    -w min(r A, clip(r, 1 - eps, 1 + eps) A) with r = pi / pi_prox and w = pi_prox / pi_behav,
    cut to [0, clip_max] ('token_truncate') or 0 outside it ('token_mask'), summed and divided
    by the tokens (dapo). Returns (loss, the share of tokens w was cut on)."""
    total, cut, n = 0.0, 0, int(mask.sum())
    for i, t in mask.nonzero().tolist():
        r = torch.exp(logps[i, t] - prox[i, t])
        w = math.exp(prox[i, t] - behav[i, t])
        cut += w > clip_max
        if mode == "token_truncate":
            w = min(w, clip_max)
        elif w > clip_max:
            w = 0.0
        total = total - w * torch.min(r * A[i], r.clamp(1 - eps, 1 + eps) * A[i])
    return total / n, cut / n


def stale_batch(seed, versions_behind):
    """A group of 6 rows, 5 tokens, some padding; the proximal policy (the one before this
    update) and a behaviour policy that drifted from it the more versions behind it sampled."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(5) < torch.tensor([5, 2, 4, 1, 5, 3])[:, None]
    prox = -3 * torch.rand(6, 5, generator=g, dtype=DT)
    behav = prox + 0.3 * versions_behind * torch.randn(6, 5, generator=g, dtype=DT)
    logps = prox + 0.1 * torch.randn(6, 5, generator=g, dtype=DT)
    return logps, prox, behav, torch.randn(6, generator=g, dtype=DT), mask


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
@pytest.mark.parametrize("versions_behind", [0, 1, 4])
def test_stale_decoupled_loss_matches_a_loop(mode, versions_behind):
    import loss
    for seed in range(3):
        logps, prox, behav, A, mask = stale_batch(seed, versions_behind)
        leaf = logps.clone().requires_grad_(True)
        got, stats = loss.decoupled_loss(leaf, prox, None, A, mask, sampler_logps=behav,
                                         loss_type="dapo", sampler_correction=mode,
                                         sampler_correction_clip_max=1.5)
        got.backward()
        brute_leaf = logps.clone().requires_grad_(True)
        want, share = brute_decoupled(brute_leaf, prox, behav, A, mask, 0.2, 1.5, mode)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(leaf.grad, brute_leaf.grad, rtol=1e-12, atol=1e-14)
        assert stats["stale/clipped"].item() == pytest.approx(share, abs=1e-15)
        assert versions_behind < 4 or share > 0  # the older the sampler, the more weights are cut


def test_stale_group_that_is_fresh_is_plain_grpo_and_a_stale_one_is_not():
    """Sampled by the proximal policy itself (0 versions behind) the weight is 1: grpo_loss's
    own gradient. Sampled 4 versions ago it is not, and on its first step (prox None:
    pi_prox = pi) the ratio is 1, so only w moves it."""
    import loss

    def grad(fn, logps, *args, **kwargs):
        leaf = logps.clone().requires_grad_(True)
        fn(leaf, *args, loss_type="dapo", **kwargs)[0].backward()
        return leaf.grad
    logps, prox, behav, A, mask = stale_batch(0, 0)
    fresh = grad(loss.decoupled_loss, logps, prox, None, A, mask, sampler_logps=behav)
    torch.testing.assert_close(fresh, grad(loss.grpo_loss, logps, prox, None, A, mask),
                               rtol=0, atol=0)
    logps, prox, behav, A, mask = stale_batch(0, 4)
    plain = grad(loss.grpo_loss, logps, None, None, A, mask)
    stale = grad(loss.decoupled_loss, logps, None, None, A, mask, sampler_logps=behav)
    w = torch.exp(logps - behav).clamp(max=3.0)
    torch.testing.assert_close(stale, torch.where(mask, w * plain, 0.0), rtol=1e-12, atol=1e-15)
    assert (stale - plain).abs().max() > 1e-3
