"""
Datasets for RL on verifiable tasks: built-in tasks generated from a seed (no files, no download), a loader for
user datasets in JSON Lines, the tokenizer, and which rewards a dataset is scored with by default.

A dataset is a list of rows: dicts with a "prompt" and an "answer" string, plus any other columns, which travel
along to the reward functions (see reward.py). The prompt is fed to the model as is, so it already is the
task's template: a built-in task writes it short ('47+385='), a JSON Lines user writes it however they like.

Every dataset has a "train" split and a disjoint held-out "test" split. A problem's split is decided by a hash
of its prompt, so the same problem can never land in both, whatever the seed or the size asked for.
"""
import hashlib
import inspect
import itertools
import json
import os
import random

import tiktoken

from reward import RESERVED_COLUMNS, to_number

TEST_PERCENT = 10  # share of all problems, by prompt hash, held out for evaluation
DEFAULT_SIZE = {"train": 10000, "test": 500}
ROW_EXAMPLE = '{"prompt": "2+2=", "answer": "4"}'

def get_tokenizer(name):
    """A tiktoken Encoding; enc.eot_token is the eos that ends every completion."""
    if name == "bytes":
        # one token per byte and no merges: a 257-token vocab for tiny models, built here so nothing is downloaded
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": 256})
    if name == "gpt2":
        return tiktoken.get_encoding("gpt2")  # downloaded by tiktoken on first use, then cached
    raise ValueError(f"unknown tokenizer {name!r}; use 'bytes' (built-in tasks, no download) or 'gpt2'")

def split_of(prompt):
    """'test' for the TEST_PERCENT of prompts whose hash falls there, else 'train'."""
    h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    return "test" if h % 100 < TEST_PERCENT else "train"

# -----------------------------------------------------------------------------
# built-in tasks. Each takes its options and returns (count, problem): problem(i) is the i-th of `count`
# distinct problems, so drawing distinct rows is drawing distinct indices. To add a task, add it to TASKS.

def addition(digits=3):
    """'47+385=' -> '432': the sum of two numbers below 10**digits, and nothing else, so a tiny model can learn it."""
    n = 10 ** digits
    def problem(i):
        a, b = divmod(i, n)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}
    return n * n, problem

def sort(length=4, digits=1):
    """'sort 3 9 1 4:' -> '1 3 4 9': `length` numbers below 10**digits, in ascending order."""
    n = 10 ** digits
    def problem(i):
        xs = [i // n ** k % n for k in range(length)]  # the base-n digits of i
        return {"prompt": f"sort {' '.join(map(str, xs))}:", "answer": " ".join(map(str, sorted(xs)))}
    return n ** length, problem

TASKS = {"addition": addition, "sort": sort}

def _task_rows(name, split, seed, size, options):
    """Up to `size` distinct problems of task `name` from `split`, drawn with `seed`."""
    known = inspect.signature(TASKS[name]).parameters
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"task {name!r} has no option {key!r}; its options are: {', '.join(known)}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:  # every task option is a count
            raise ValueError(f"task option {key} must be a positive integer, got {value!r}")
    count, problem = TASKS[name](**options)
    rng = random.Random(seed)
    share = TEST_PERCENT if split == "test" else 100 - TEST_PERCENT  # percent of the problems in this split
    if count <= 1 << 16:
        order = rng.sample(range(count), count)  # small space: shuffle all of it, so `size` caps at what there is
    elif size > count * share // 200:  # past half of the split, draws would mostly hit problems already drawn
        raise ValueError(f"task {name!r} with {options} has about {count * share // 100} {split} problems, too few "
                         f"to draw {size} distinct ones at random; ask for at most {count * share // 200} rows")
    else:
        order = (rng.randrange(count) for _ in itertools.count())  # huge space: repeats are rare, skipped below
    rows, seen = [], set()
    for i in order:
        if len(rows) == size:
            break
        if i not in seen:
            seen.add(i)
            row = problem(i)
            if split_of(row["prompt"]) == split:
                rows.append(row)
    return rows

# -----------------------------------------------------------------------------
# JSON Lines

def _parse_row(line, where):
    """One JSON Lines row as a dataset row; `where` ('file:line') starts every error message."""
    try:
        row = json.loads(line.rstrip())  # else an error at its end points past the newline
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                         f"object like {ROW_EXAMPLE}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object like {ROW_EXAMPLE}, got a {type(row).__name__}")
    if "prompt" not in row and "question" in row:  # GSM8K layout: the answer is a worked solution ending '#### 42'
        row["prompt"] = row.pop("question")
        if isinstance(row.get("answer"), str) and "####" in row["answer"]:
            row["solution"] = row["answer"]
            row["answer"] = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    for key in ("prompt", "answer"):
        if key not in row:
            raise ValueError(f'{where}: no "{key}"; every row needs a "prompt" (or GSM8K "question") and an "answer"')
    if not isinstance(row["prompt"], str):
        raise ValueError(f'{where}: "prompt" must be a string, got {json.dumps(row["prompt"])}')
    if isinstance(row["answer"], bool) or not isinstance(row["answer"], (str, int, float)):
        raise ValueError(f'{where}: "answer" must be a string or a number, got {json.dumps(row["answer"])}')
    row["answer"] = str(row["answer"])
    for key in RESERVED_COLUMNS:
        if key in row:
            raise ValueError(f'{where}: column "{key}" is reserved for what the rollout passes to reward functions; '
                             f"rename it")
    return row

def _read_jsonl(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file {path} not found; give the path of a .jsonl file or a built-in "
                                f"task ({', '.join(TASKS)})")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():  # blank lines, such as a trailing one, are not rows
                row = _parse_row(line, f"{path}:{lineno}")
                if rows and row.keys() != rows[0].keys():  # reward functions get every column for every row
                    raise ValueError(f"{path}:{lineno}: columns {sorted(row)} differ from the first row's "
                                     f"{sorted(rows[0])}; every row needs the same columns")
                rows.append(row)
    if not rows:
        raise ValueError(f"{path} is empty; it needs one JSON object per line, like {ROW_EXAMPLE}")
    return rows

# -----------------------------------------------------------------------------

def load_dataset(name, split="train", seed=0, size=None, **task_options):
    """The rows of dataset `name`'s `split` ('train' or 'test'). `name` is one of:
    - a built-in task (see TASKS), with its options as keyword arguments: `size` distinct problems drawn with
      `seed` (default 10000 train, 500 test; fewer if the task has fewer problems in that split);
    - a path ending in '{split}.jsonl', e.g. 'data/gsm8k/{split}.jsonl': the split picks the file;
    - any other path ending in '.jsonl': the file is split by prompt hash, like the built-in tasks.
    A file's rows keep their order (shuffling is the trainer's job) and `size` keeps the first `size` of them."""
    if split not in DEFAULT_SIZE:
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"size must be a positive integer or None, got {size!r}")
    if name.endswith(".jsonl"):
        if task_options:
            raise ValueError(f"options {sorted(task_options)} apply to built-in tasks only, not to {name}")
        if "{split}" in name:
            return _read_jsonl(name.replace("{split}", split))[:size]
        rows = [row for row in _read_jsonl(name) if split_of(row["prompt"]) == split]
        if not rows:
            raise ValueError(f"{name}: none of its rows falls in the {split} split ({TEST_PERCENT}% of prompts by "
                             f"hash are held out); add rows, or give a path like 'data/{{split}}.jsonl'")
        return rows[:size]
    if name not in TASKS:
        raise ValueError(f"unknown dataset {name!r}; use a built-in task ({', '.join(TASKS)}) or a .jsonl path")
    return _task_rows(name, split, seed, DEFAULT_SIZE[split] if size is None else size, task_options)

def default_reward(name, rows):
    """(names for reward.get_reward_fns, weights): how dataset `name` with these `rows` is scored unless the
    config says otherwise."""
    if name in TASKS or any(to_number(row["answer"]) is None for row in rows):
        return ["exact_match"], [1.0]
    # numeric answers (GSM8K): check the value, not its spelling, and nudge the model to end on its answer
    return ["numeric_match", "format"], [1.0, 0.1]
