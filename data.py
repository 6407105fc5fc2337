"""
Datasets for RL on verifiable tasks: built-in tasks generated from a seed (no files, no
download), a loader for user datasets in JSON Lines, and which rewards a dataset is
scored with by default.

A dataset is a list of rows: dicts with a "prompt" (a string, or a list of
{"role", "content"} messages for a chat template) and an "answer" string, plus any other
columns, which travel along to the reward functions (see reward.py). The prompt is fed
to the model as is (or as the user message of a chat template), so it already is the
task's template: a built-in task for a tiny model writes it short ('47+385='),
Countdown and GSM8K ask in words for the answer in a \\boxed{}, a JSON Lines user writes
it however they like.

Every dataset has a "train" split and a disjoint held-out "test" split. A problem's
split is decided by a hash of the problem, so the same problem can never land in both,
whatever the seed or the size asked for: of its prompt, or, where a task asks one
problem in several ways, of what they share (times_table: the pair of factors, whichever
way round and however worded; sort: the numbers, in whatever order), so a held-out
question is never trained on in other words.
"""
import hashlib
import inspect
import itertools
import json
import math
import os
import random

import reward_model
from reward import RESERVED_COLUMNS, get_reward_fns, to_number
from lib.chat import encode_prompt
from lib.errors import ConfigError

# share of all problems, by prompt hash, held out for evaluation
TEST_PERCENT = 10
# few problems asked in several ways (times_table): hold out exactly TEST_PERCENT
SMALL_TASK = 1000
DEFAULT_SIZE = {"train": 10000, "test": 500}
ROW_EXAMPLE = '{"prompt": "2+2=", "answer": "4"}'
# what GSM8K's question is followed by: the wording Qwen2.5-Math and DeepSeek-R1 were
# trained and evaluated with, so instruct models already answer in the form the boxed
# reward and the answer extractor read
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

def _hash(prompt):
    # a list of chat messages hashes as its JSON, keys sorted so that their order does
    # not count
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

def split_of(prompt):
    """'test' for the TEST_PERCENT of prompts whose hash falls there, else 'train'."""
    return "test" if _hash(prompt) % 100 < TEST_PERCENT else "train"

def _key(row):
    """What splits a built-in task's row: its '_problem' (popped from the row), else its
    prompt."""
    return row.pop("_problem", row["prompt"])

def _held_out(keys):
    """The TEST_PERCENT of keys whose hash is smallest: for a task of few problems each
    asked in several ways, where the hash's threshold alone would stray far from that
    share (times_table's 66 pairs of factors: 1 held out)."""
    ranked = sorted(set(keys), key=_hash)
    return set(ranked[:max(1, round(len(ranked) * TEST_PERCENT / 100))])

# -----------------------------------------------------------------------------
# built-in tasks. Each takes its options and returns (count, problem): problem(i) is the
# i-th of `count` problems. Rows are distinct by prompt, so several indices may give one
# problem (countdown's do), but `count` should be about how many distinct ones there
# are: _task_rows' size check trusts it. Options are positive integers, or tuples of
# them where the default is a tuple. To add a task, add it to TASKS.

def addition(digits=2):
    """'47+38=' -> '85': the sum of two numbers below 10**digits, and nothing else, so a
    tiny model can learn it."""
    n = 10 ** digits
    def problem(i):
        a, b = divmod(i, n)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}
    return n * n, problem

def sort(length=4, digits=1):
    """'sort 3 9 1 4:' -> '1 3 4 9': `length` numbers below 10**digits, in ascending
    order; the split goes by the numbers, so no order of a held-out list is trained."""
    n = 10 ** digits
    def problem(i):
        # the base-n digits of i
        xs = [i // n ** k % n for k in range(length)]
        answer = " ".join(map(str, sorted(xs)))
        return {"prompt": f"sort {' '.join(map(str, xs))}:", "answer": answer,
                "_problem": answer}
    return n ** length, problem

def _countdown_solution(rng, numbers, max_target):
    """(expression, value): a random expression using each of `numbers` once, every
    value along the way a whole number in [1, max_target]. Given x >= y in that range,
    x - y (x > y) or x / y (x = y) is too, so it never fails."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0]
    # the numbers are shuffled: this makes two random groups
    k = rng.randint(1, len(numbers) - 1)
    left = _countdown_solution(rng, numbers[:k], max_target)
    right = _countdown_solution(rng, numbers[k:], max_target)
    (a, x), (b, y) = sorted([left, right], key=lambda e: -e[1])
    a, b = (e if e.isdigit() else f"({e})" for e in (a, b))
    options = [(f"{a} + {b}", x + y), (f"{a} - {b}", x - y), (f"{a} * {b}", x * y)]
    if x % y == 0:
        options.append((f"{a} / {b}", x // y))
    return rng.choice([(e, v) for e, v in options if 1 <= v <= max_target])

def countdown(count=(3, 4), max_number=99, max_target=100):
    """TinyZero's Countdown: reach a target with + - * / and parentheses, using each
    given number exactly once. A problem has `count` numbers (count=(3, 4): half of the
    problems 3, half 4) drawn from 1..max_number and a target in 1..max_target, built
    from a random expression over the numbers, so every problem has a solution: the
    answer, one solution such as '(44 + 19) - 35'. Columns `numbers` and `target` reach
    reward.countdown_reward. A prompt: 'Using the numbers [44, 19, 35], create an
    equation that equals 28. You can use + - * / and parentheses, and each number
    exactly once. Please reason step by step, and put your final answer within
    \\boxed{}.'"""
    # a lone number is an expression too: it must fit the target
    if max_target < max_number:
        raise ConfigError(f"task 'countdown' needs max_target >= max_number, "
                          f"got max_target={max_target} and max_number={max_number}")
    def problem(i):
        # i picks the count, then the rest of i's digits in base max_number pick the
        # numbers: each index of the largest count is a problem of its own; a smaller
        # count leaves digits unused, so its numbers recur, mostly with other targets
        # (rows are distinct by prompt)
        n, digits = count[i % len(count)], i // len(count)
        numbers = [digits // max_number ** k % max_number + 1 for k in range(n)]
        rng = random.Random(i)
        answer, target = _countdown_solution(rng, rng.sample(numbers, n), max_target)
        prompt = (f"Using the numbers {numbers}, "
                  f"create an equation that equals {target}. "
                  f"You can use + - * / and parentheses, and each number exactly once. "
                  f"{BOXED_INSTRUCTION}")
        return {"prompt": prompt, "answer": answer, "numbers": numbers, "target": target}
    return len(count) * max_number ** max(count), problem

TIMES_QUESTIONS = ("What is {a} times {b}?", "What is {a} * {b}?",
                   "Multiply {a} by {b}.", "What is the product of {a} and {b}?")

def times_table(max_factor=12):
    """'What is 7 times 8?' -> '56': the times table from 2 x 2 to
    max_factor x max_factor, each product asked in the four ways of TIMES_QUESTIONS, for
    a chat model to answer in its own words (config/smollm2.py; the reward reads the
    last number of the answer). The split goes by the pair of factors: a held-out
    product is never trained, in any wording, either way round."""
    n = max_factor - 1
    def problem(i):
        a, b = divmod(i // len(TIMES_QUESTIONS), n)
        question = TIMES_QUESTIONS[i % len(TIMES_QUESTIONS)]
        return {"prompt": question.format(a=a + 2, b=b + 2),
                "answer": str((a + 2) * (b + 2)),
                "_problem": f"{min(a, b) + 2} x {max(a, b) + 2}"}
    return len(TIMES_QUESTIONS) * n * n, problem

def multiplication(digits=3):
    """'512*347=' -> '177664': the product of two numbers of `digits` digits whose
    product has twice as many (from 317*317 for 3 digits), which a tiny model cannot
    work out in its head but can with a calculator (config/tools.py). Each row holds a
    demonstration for the warm start: the policy's turns, '<512*347>' (a call of
    envs.Calculator) and, after the observation, the answer."""
    low = math.isqrt(10 ** (2 * digits - 1) - 1) + 1
    n = 10 ** digits - low
    def problem(i):
        a, b = low + i // n, low + i % n
        return {"prompt": f"{a}*{b}=", "answer": str(a * b),
                "demonstration": [f"<{a}*{b}>", str(a * b)]}
    return n * n, problem

TASKS = {"addition": addition, "sort": sort, "countdown": countdown,
         "times_table": times_table, "multiplication": multiplication}

def _task_rows(name, split, seed, size, options):
    """Up to `size` distinct problems of task `name` from `split`, drawn with `seed`."""
    known = inspect.signature(TASKS[name]).parameters
    for key, value in options.items():
        if key not in known:
            raise ConfigError(f"task {name!r} has no option {key!r} (task_options); "
                              f"its options are: {', '.join(known)}")
        many = isinstance(known[key].default, tuple)
        # a lone value where the default is a tuple is a tuple of one:
        # count=3 is count=(3,)
        values = tuple(value) if many and isinstance(value, (tuple, list)) else (value,)
        positive = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                       for v in values)
        if not values or not positive:
            kind = ("a positive integer or a tuple of them" if many
                    else "a positive integer")
            raise ConfigError(f"task_options[{key!r}] of task {name!r} must be {kind}, "
                              f"got {value!r}")
        options[key] = values if many else value
    count, problem = TASKS[name](**options)
    rng = random.Random(seed)
    # % of the problems in `split`
    share = TEST_PERCENT if split == "test" else 100 - TEST_PERCENT
    # few problems, asked in several ways
    few = count <= SMALL_TASK and "_problem" in problem(0)
    held = _held_out(_key(problem(i)) for i in range(count)) if few else None
    if count <= 1 << 16:
        # a small space: all of it, so `size` caps at that
        order = rng.sample(range(count), count)
    elif size > count * share // 200:
        # past half of the split, most draws would be repeats
        raise ConfigError(f"task {name!r} with {options} has about "
                          f"{count * share // 100} {split} problems, "
                          f"too few to draw {size} distinct ones at random; "
                          f"ask for at most {count * share // 200} rows (eval_size)")
    else:
        # a huge space: repeats are rare, and skipped below
        order = (rng.randrange(count) for _ in itertools.count())
    rows, seen = [], set()
    for i in order:
        if len(rows) == size:
            break
        row = problem(i)
        key = _key(row)
        test = key in held if held is not None else split_of(key) == "test"
        if row["prompt"] not in seen and test == (split == "test"):
            seen.add(row["prompt"])
            rows.append(row)
    return rows

# -----------------------------------------------------------------------------
# JSON Lines

def _parse_row(line, where):
    """One JSON Lines row as a dataset row; `where` ('file:line') starts every error
    message."""
    try:
        # stripped, else an error at its end points past the newline
        row = json.loads(line.rstrip())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); each "
                          f"line must be one JSON object like {ROW_EXAMPLE}") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object like {ROW_EXAMPLE}, "
                          f"got a {type(row).__name__}")
    # GSM8K's layout: a "question", and an answer that is a worked solution ending
    # '#### 42'
    if "prompt" not in row and "question" in row:
        row["prompt"] = f"{row.pop('question')}\n{BOXED_INSTRUCTION}"
        if isinstance(row.get("answer"), str) and "####" in row["answer"]:
            row["solution"] = row["answer"]
            row["answer"] = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    for key in ("prompt", "answer"):
        if key not in row:
            raise ConfigError(f'{where}: no "{key}"; every row needs a "prompt" '
                              f'(or GSM8K "question") and an "answer"')
    messages = isinstance(row["prompt"], list) and all(
        isinstance(m, dict) and {"role", "content"} <= set(m) for m in row["prompt"])
    if not (isinstance(row["prompt"], str) or row["prompt"] and messages):
        raise ConfigError(f'{where}: "prompt" must be a string or a list of '
                          f'{{"role", "content"}} messages (for a chat_template), '
                          f'got {json.dumps(row["prompt"])[:200]}')
    if (isinstance(row["answer"], bool)
            or not isinstance(row["answer"], (str, int, float))):
        raise ConfigError(f'{where}: "answer" must be a string or a number, '
                          f'got {json.dumps(row["answer"])}')
    row["answer"] = str(row["answer"])
    for key in RESERVED_COLUMNS:
        if key in row:
            raise ConfigError(f'{where}: column "{key}" is reserved for what the '
                              f'rollout passes to reward functions; rename it')
    return row

def _read_jsonl(path):
    if not os.path.isfile(path):
        raise ConfigError(f"dataset file {path} not found; "
                          f"give the path of a .jsonl file "
                          f"or a built-in task ({', '.join(TASKS)})")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            # blank lines, such as a trailing one, are not rows
            if line.strip():
                row = _parse_row(line, f"{path}:{lineno}")
                # reward functions get every column for every row
                if rows and row.keys() != rows[0].keys():
                    raise ConfigError(f"{path}:{lineno}: columns {sorted(row)} differ "
                                      f"from the first row's {sorted(rows[0])}; "
                                      f"every row needs the same columns")
                rows.append(row)
    if not rows:
        raise ConfigError(f"{path} is empty; it needs one JSON object per line, "
                          f"like {ROW_EXAMPLE}")
    return rows

# -----------------------------------------------------------------------------

def load_dataset(name, split="train", seed=0, size=None, **task_options):
    """The rows of dataset `name`'s `split` ('train' or 'test'). `name` is one of:
    - a built-in task (see TASKS), with its options as keyword arguments: `size`
      distinct problems drawn with `seed` (default 10000 train, 500 test; fewer if the
      task has fewer problems in that split);
    - a path ending in '{split}.jsonl', e.g. 'data/gsm8k/{split}.jsonl': the split
      picks the file;
    - any other path ending in '.jsonl': the file is split by prompt hash, like the
      built-in tasks.
    A file's rows keep their order (shuffling is the trainer's job) and `size` keeps
    the first `size` of them."""
    if split not in DEFAULT_SIZE:
        raise ConfigError(f"unknown split {split!r}; use 'train' or 'test'")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                             or size < 1):
        raise ConfigError(f"size must be a positive integer or None, got {size!r}")
    if name.endswith(".jsonl"):
        if task_options:
            raise ConfigError(f"task_options {task_options} apply to built-in tasks "
                              f"only, not to the file {name}; drop task_options")
        if "{split}" in name:
            return _read_jsonl(name.replace("{split}", split))[:size]
        rows = [row for row in _read_jsonl(name) if split_of(row["prompt"]) == split]
        if not rows:
            raise ConfigError(f"{name}: none of its rows falls in the {split} split "
                              f"({TEST_PERCENT}% of prompts by hash are held out); "
                              f"add rows, or give a path like 'data/{{split}}.jsonl'")
        return rows[:size]
    if name not in TASKS:
        raise ConfigError(f"unknown dataset {name!r}; "
                          f"use a built-in task ({', '.join(TASKS)}) or a .jsonl path")
    size = DEFAULT_SIZE[split] if size is None else size
    return _task_rows(name, split, seed, size, task_options)

def default_reward(name, rows):
    """(names for reward.get_reward_fns, weights): how dataset `name` with these `rows`
    is scored unless the config says otherwise. The verifier comes first (the accuracy,
    unless the config names another), then a format reward at 0.1 where there is one: a
    right answer in any form (1.0) outranks a well-formed wrong one (0.1), yet in a
    group of wrong answers the well-formed ones still get the advantage, toward what the
    verifier reads best."""
    # Countdown, built-in or from a file
    if rows and {"numbers", "target"} <= rows[0].keys():
        return ["countdown_reward", "boxed"], [1.0, 0.1]
    # tool use: the answer given after the tool's result
    if rows and "demonstration" in rows[0]:
        return ["final_answer_match"], [1.0]
    if name in TASKS or any(to_number(row["answer"]) is None for row in rows):
        return ["exact_match"], [1.0]
    # numeric answers (GSM8K): check the value, not its spelling, and reward the form
    # the prompt asks for: a \boxed{} where it asks for one (the GSM8K layout's prompt
    # does), else ending on the number
    boxed = all("\\boxed" in row["prompt"] for row in rows)
    return ["numeric_match", "boxed" if boxed else "format"], [1.0, 0.1]


def check_rows(rows, name, cfg, enc, least=1):
    """A dataset's rows fit the run: at least `least` prompts (the training set: a
    step's), each with the longest completion within block_size. Checked at start-up,
    not at the first long prompt hours in."""
    if len(rows) < least:
        raise ConfigError(f"{name} has {len(rows)} prompts but "
                          f"prompts_per_step={least}; "
                          f"lower prompts_per_step or add data")
    longest = max(len(encode_prompt(r['prompt'], cfg, enc)) for r in rows)
    if longest + cfg.max_completion_length > cfg.block_size:
        raise ConfigError(f"{name}: longest prompt is {longest} tokens, "
                          f"+ max_completion_length={cfg.max_completion_length} "
                          f"> block_size={cfg.block_size}; "
                          f"shorten prompts or max_completion_length, "
                          f"or raise block_size")


def load_task(cfg, enc):
    """The run's data and rewards, with everything that can be wrong with them found
    now, before any work: (train rows, held-out rows, reward functions, their weights).
    evaluate.with_accuracy picks the accuracy."""
    test_task = cfg.test_task or cfg.task
    train = load_dataset(cfg.task, 'train', seed=cfg.seed, **cfg.task_options)
    test = load_dataset(test_task, 'test', seed=cfg.seed, size=cfg.eval_size,
                        **cfg.task_options)
    if cfg.reward_funcs:
        names, weights = (cfg.reward_funcs,
                          cfg.reward_weights or (1.0,) * len(cfg.reward_funcs))
    else:
        names, weights = default_reward(cfg.task, train)
    check_rows(train, cfg.task, cfg, enc, least=cfg.prompts_per_step)
    check_rows(test, test_task, cfg, enc)
    fns = [reward_model.reward_fn(n, cfg) if reward_model.is_model(n)
           else get_reward_fns(n)[0]
           for n in names]
    return train, test, fns, list(weights)
