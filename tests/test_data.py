"""
Tests for data.py: the byte tokenizer, the built-in tasks (answers checked by recomputing them from the prompt,
Countdown's solutions with Python's own arithmetic, splits disjoint and deterministic), the JSON Lines loader on good
and malformed files (GSM8K's layout included), and default rewards.
"""
import itertools
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from configurator import ConfigError
from data import default_reward, load_dataset, split_of
from reward import compute_rewards, get_reward_fns
from lib.tokenizer import get_tokenizer

def test_bytes_tokenizer_round_trip():
    enc = get_tokenizer("bytes")
    assert enc.n_vocab == 257 and enc.eot_token == 256
    for task in ["addition", "sort"]:
        for row in load_dataset(task, "test", size=50):
            for text in [row["prompt"], row["answer"]]:
                ids = enc.encode_ordinary(text)
                assert ids == list(text.encode()) and enc.decode(ids) == text
    ids = enc.encode_ordinary("héllo <|endoftext|>")  # special text in data is plain text, not an eos
    assert 256 not in ids and enc.decode(ids) == "héllo <|endoftext|>"

# -----------------------------------------------------------------------------
# built-in tasks

def test_addition_answers():
    rows = load_dataset("addition", "train", seed=1, size=300, digits=3)
    assert len(rows) == 300 and len({r["prompt"] for r in rows}) == 300
    for r in rows:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert r["prompt"].endswith("=") and len(a) <= 3 and len(b) <= 3
        assert r["answer"] == str(int(a) + int(b))

def test_times_table_answers():
    """Every product from 2 x 2 to 12 x 12, asked each of four ways, once, and split between train and test."""
    train, test = load_dataset("times_table", "train"), load_dataset("times_table", "test")
    rows = train + test
    assert len(rows) == len({r["prompt"] for r in rows}) == 4 * 11 * 11 and 30 < len(test) < 80
    for r in rows:
        a, b = map(int, re.findall(r"\d+", r["prompt"]))
        assert 2 <= a <= 12 and 2 <= b <= 12 and r["answer"] == str(a * b)
    assert {r["prompt"].split(" ")[0] for r in rows} == {"What", "Multiply"}
    assert len(load_dataset("times_table", "train", max_factor=5)) < 4 * 4 * 4
    # held out by the pair of factors: no held-out product is trained, in any of the four ways, either way round
    pair = lambda r: tuple(sorted(map(int, re.findall(r"\d+", r["prompt"]))))
    assert not {pair(r) for r in train} & {pair(r) for r in test}
    assert all(len([r for r in test if pair(r) == p]) == 4 * len(set(p)) for p in {pair(r) for r in test})
    assert all("_problem" not in r for r in rows)

def test_sort_holds_out_the_numbers_in_every_order():
    train, test = load_dataset("sort", "train"), load_dataset("sort", "test")
    assert not {r["answer"] for r in train} & {r["answer"] for r in test} and len(test) > 100

def test_sort_answers():
    rows = load_dataset("sort", "train", seed=1, size=300, length=5, digits=2)
    assert len({r["prompt"] for r in rows}) == 300
    for r in rows:
        assert r["prompt"].startswith("sort ") and r["prompt"].endswith(":")
        xs = [int(x) for x in r["prompt"][5:-1].split(" ")]
        assert len(xs) == 5 and all(0 <= x < 100 for x in xs)
        assert r["answer"] == " ".join(str(x) for x in sorted(xs))

def countdown_prompt(numbers, target):
    return (f"Using the numbers {numbers}, create an equation that equals {target}. You can use + - * / and "
            f"parentheses, and each number exactly once. Please reason step by step, and put your final answer "
            f"within \\boxed{{}}.")

def test_countdown_problems_are_solved_by_their_answers():
    rows = load_dataset("countdown", "train", seed=1, size=2000)
    assert len({r["prompt"] for r in rows}) == 2000
    assert 800 < sum(len(r["numbers"]) == 3 for r in rows) < 1200  # count=(3, 4): about half each
    for r in rows:
        assert r.keys() == {"prompt", "answer", "numbers", "target"}
        assert r["prompt"] == countdown_prompt(r["numbers"], r["target"])
        assert len(r["numbers"]) in (3, 4) and all(1 <= x <= 99 for x in r["numbers"]) and 1 <= r["target"] <= 100
        # the answer, a trusted string written by data.py, checked independently of reward.py's parser
        assert sorted(map(int, re.findall(r"\d+", r["answer"]))) == sorted(r["numbers"])
        assert re.fullmatch(r"[\d+\-*/() ]+", r["answer"]) and eval(r["answer"]) == r["target"]
    names, weights = default_reward("countdown", rows)
    total, _ = compute_rewards(get_reward_fns(names), weights, [r["prompt"] for r in rows],
                               [f"\\boxed{{{r['answer']}}}" for r in rows],
                               {"numbers": [r["numbers"] for r in rows], "target": [r["target"] for r in rows]})
    assert total == [1.1] * len(rows)

def test_countdown_options():
    rows = load_dataset("countdown", "test", size=300, count=5, max_number=20, max_target=50)
    assert len(rows) == 300
    for r in rows:
        assert len(r["numbers"]) == 5 and max(r["numbers"]) <= 20 and 1 <= r["target"] <= 50
        assert eval(r["answer"]) == r["target"]
    # 27 triples and 9 pairs of numbers in 1..3, each pair drawn for 3 indices: asking for more than there are
    # returns every problem once, in one split, and no pair with the same target twice
    train = load_dataset("countdown", "train", size=1000, count=(2, 3), max_number=3, max_target=9)
    test = load_dataset("countdown", "test", size=1000, count=[2, 3], max_number=3, max_target=9)
    prompts = [r["prompt"] for r in train + test]
    assert len(prompts) == len(set(prompts)) and 27 + 9 <= len(prompts) <= 27 + 27
    assert {tuple(r["numbers"]) for r in train + test} == set(itertools.product((1, 2, 3), repeat=2)) | \
        set(itertools.product((1, 2, 3), repeat=3))
    assert load_dataset("countdown", "test", count=3, max_number=3) == \
        load_dataset("countdown", "test", count=(3,), max_number=3)  # a single count needs no tuple

def test_splits_partition_a_small_problem_space():
    # 1-digit addition has 100 problems: asking for more than there are returns each exactly once, in one split
    train = load_dataset("addition", "train", size=1000, digits=1)
    test = load_dataset("addition", "test", size=1000, digits=1)
    everything = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    assert {r["prompt"] for r in train} | {r["prompt"] for r in test} == everything
    assert len(train) + len(test) == 100 and 0 < len(test) < 30

@pytest.mark.parametrize("task, options", [("addition", {"digits": 2}), ("addition", {"digits": 4}), ("sort", {}),
                                           ("countdown", {})])
def test_splits_disjoint_and_deterministic(task, options):
    train = load_dataset(task, "train", seed=0, size=2000, **options)
    test = load_dataset(task, "test", seed=0, size=500, **options)
    assert len(train) == 2000 and len(test) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert load_dataset(task, "test", seed=0, size=500, **options) == test  # same seed, same rows, same order
    other = load_dataset(task, "train", seed=1, size=2000, **options)
    assert other != train and not {r["prompt"] for r in other} & {r["prompt"] for r in test}

def test_default_sizes():
    assert len(load_dataset("addition", digits=3)) == 10000 and len(load_dataset("addition", "test")) == 500
    # 2 digits by default: every one of the 10**4 problems that hashes into the train split (about 90%)
    assert len(load_dataset("addition")) == sum(split_of(f"{a}+{b}=") == "train" for a in range(100) for b in range(100))

COUNT = "task_options\\['count'\\] of task 'countdown'"


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="multiply"), "unknown dataset 'multiply'; use a built-in task \\(addition, sort, countdown, "
                            "times_table, multiplication\\) or a .jsonl path"),
    (dict(name="addition", split="val"), "unknown split 'val'; use 'train' or 'test'"),
    (dict(name="addition", size=0), "size must be a positive integer or None, got 0"),
    (dict(name="addition", size=2.5), "size must be a positive integer or None, got 2.5"),
    (dict(name="addition", digit=2), "task 'addition' has no option 'digit' \\(task_options\\); its options are: digits"),
    (dict(name="sort", length=0), "task_options\\['length'\\] of task 'sort' must be a positive integer, got 0"),
    (dict(name="sort", digits="2"), "task_options\\['digits'\\] of task 'sort' must be a positive integer, got '2'"),
    (dict(name="addition", digits=(2, 3)), "task_options\\['digits'\\] of task 'addition' must be a positive "
                                           "integer, got \\(2, 3\\)"),
    (dict(name="countdown", numbers=4), "task 'countdown' has no option 'numbers' \\(task_options\\); its "
                                        "options are: count, max_number, max_target"),
    (dict(name="countdown", count=(3, 0)), f"{COUNT} must be a positive integer or a tuple of them, got \\(3, 0\\)"),
    (dict(name="countdown", count=()), f"{COUNT} must be a positive integer or a tuple of them, got \\(\\)"),
    (dict(name="countdown", count="34"), f"{COUNT} must be a positive integer or a tuple of them, got '34'"),
    (dict(name="countdown", max_number=0), "task_options\\['max_number'\\] of task 'countdown' must be a positive "
                                           "integer, got 0"),
    (dict(name="countdown", max_number=200), "task 'countdown' needs max_target >= max_number, got max_target=100 "
                                             "and max_number=200"),
    (dict(name="sort", length=9, size=10**9), "task 'sort' with {'length': 9} has about 900000000 train problems, "
                                              "too few to draw 1000000000 distinct ones at random; ask for at most "
                                              "450000000 rows"),
    (dict(name="sort", split="test", length=5, size=6000), "has about 10000 test problems, too few to draw 6000 "),
])
def test_task_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_dataset(**kwargs)

# -----------------------------------------------------------------------------
# JSON Lines

def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)

def test_jsonl_rows_and_extra_columns(tmp_path):
    lines = [json.dumps({"prompt": f"Q{i}?", "answer": i, "level": i % 3}) for i in range(200)]
    path = write(tmp_path / "mine.jsonl", lines[:100] + [""] + lines[100:])  # a blank line is not a row
    train, test = load_dataset(path, "train"), load_dataset(path, "test")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert sorted(train + test, key=lambda r: int(r["answer"])) == \
        [{"prompt": f"Q{i}?", "answer": str(i), "level": i % 3} for i in range(200)]
    assert 0 < len(test) < 50
    assert [int(r["answer"]) for r in train] == sorted(int(r["answer"]) for r in train)  # file order kept
    assert load_dataset(path, "train", size=5) == train[:5]

def test_jsonl_split_in_path(tmp_path):
    write(tmp_path / "train.jsonl", [json.dumps({"prompt": "a", "answer": "1"})] * 3)
    write(tmp_path / "test.jsonl", [json.dumps({"prompt": "b", "answer": "2"})])
    path = str(tmp_path / "{split}.jsonl")
    assert load_dataset(path, "train") == [{"prompt": "a", "answer": "1"}] * 3
    assert load_dataset(path, "test") == [{"prompt": "b", "answer": "2"}]

def test_gsm8k_layout(tmp_path):
    solution = "She sold 48/2 = <<48/2=24>>24 clips in May.\nIn all 1,048+24 = <<1048+24=1072>>1072 clips.\n#### 1,072"
    write(tmp_path / "train.jsonl", [json.dumps({"question": "How many clips?", "answer": solution})])
    rows = load_dataset(str(tmp_path / "{split}.jsonl"))
    prompt = "How many clips?\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert rows == [{"prompt": prompt, "answer": "1072", "solution": solution}]
    assert default_reward("data/gsm8k/{split}.jsonl", rows) == (["numeric_match", "boxed"], [1.0, 0.1])

@pytest.mark.parametrize("line, message", [
    ('{"prompt": "2+2=", "answer": "4"', "invalid JSON \\(Expecting ',' delimiter at column 33\\); each line must "
                                        "be one JSON object like"),
    ('["2+2=", "4"]', "expected a JSON object like .*, got a list"),
    ('{"prompt": "2+2="}', 'no "answer"; every row needs a "prompt" \\(or GSM8K "question"\\) and an "answer"'),
    ('{"text": "2+2=", "answer": "4"}', 'no "prompt"; every row needs a "prompt"'),
    ('{"prompt": ["2+2="], "answer": "4"}', '"prompt" must be a string or a list of \\{"role", "content"\\} messages \\(for a chat_template\\), got \\["2\\+2="\\]'),
    ('{"prompt": "2+2=", "answer": true}', '"answer" must be a string or a number, got true'),
    ('{"prompt": "2+2=", "answer": null}', '"answer" must be a string or a number, got null'),
    ('{"prompt": "2+2=", "answer": "4", "truncated": false}', 'column "truncated" is reserved'),
    ('{"prompt": "2+2=", "answer": "4", "level": 1}',
     "columns \\['answer', 'level', 'prompt'\\] differ from the first row's \\['answer', 'prompt'\\]; every row"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    good = json.dumps({"prompt": "1+1=", "answer": "2"})
    path = write(tmp_path / "bad.jsonl", [good, "", line, good])
    with pytest.raises(ValueError) as e:
        load_dataset(path)
    assert str(e.value).startswith(f"{path}:3: ") and "\n" not in str(e.value)
    assert re.search(message, str(e.value)), str(e.value)

def test_empty_and_missing_files(tmp_path):
    path = write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=f"{path} is empty; it needs one JSON object per line, like"):
        load_dataset(path)
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=f"dataset file {missing} not found; give the path of a .jsonl file "
                                                f"or a built-in task \\(addition, sort, countdown, times_table, "
                                                f"multiplication\\)"):
        load_dataset(missing)

def test_jsonl_refuses_task_options_and_empty_split(tmp_path):
    path = write(tmp_path / "one.jsonl", [json.dumps({"prompt": "only one", "answer": "1"})])
    with pytest.raises(ValueError, match="task_options \\{'digits': 2\\} apply to built-in tasks only"):
        load_dataset(path, digits=2)
    split = "test" if load_dataset(path, "train") else "train"
    with pytest.raises(ValueError, match=f"none of its rows falls in the {split} split"):
        load_dataset(path, split)

# -----------------------------------------------------------------------------

def test_default_reward():
    assert default_reward("addition", load_dataset("addition", "test", size=5)) == (["exact_match"], [1.0])
    numeric = [{"prompt": "?", "answer": "1072"}, {"prompt": "?", "answer": "-0.5"}]
    names, weights = default_reward("numbers.jsonl", numeric)  # prompts that ask for no box: end on the number
    assert names == ["numeric_match", "format"] and weights == [1.0, 0.1] and len(get_reward_fns(names)) == 2
    assert default_reward("words.jsonl", numeric + [{"prompt": "?", "answer": "Paris"}]) == (["exact_match"], [1.0])
    boxed = [{"prompt": "? Put it in \\boxed{}.", "answer": "3"}]
    assert default_reward("mine.jsonl", boxed) == (["numeric_match", "boxed"], [1.0, 0.1])
    assert default_reward("mine.jsonl", boxed + numeric) == (["numeric_match", "format"], [1.0, 0.1])
    countdown = load_dataset("countdown", "test", size=5)
    names, weights = default_reward("countdown", countdown)
    assert (names, weights) == (["countdown_reward", "boxed"], [1.0, 0.1]) and len(get_reward_fns(names)) == 2
    from_file = [{"prompt": "?", "answer": "3 + 4", "numbers": [3, 4], "target": 7}]  # Countdown rows from a file
    assert default_reward("countdown.jsonl", from_file) == (["countdown_reward", "boxed"], [1.0, 0.1])


def test_chat_message_prompts_load(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1="}],
             "answer": str(i + 1)} for i in range(30)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = load_dataset(str(tmp_path / "chat.jsonl"), "train")
    test = load_dataset(str(tmp_path / "chat.jsonl"), "test")
    assert len(train) + len(test) == 30 and all(r in rows for r in train + test)
