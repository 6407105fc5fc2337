"""
Tests for reward.py: each built-in reward function against hand-worked cases, the GSM8K answer extractor and the
Countdown verifier against tables of tricky answers, compute_rewards' weighting and every error it raises (the
message text included), and pass@k against a brute-force enumeration of subsets. Numbers compared exactly; the
linear-time readers against the plain backtracking regexes on random short texts; every built-in reward's
contract, and its time on 100,000-character pathological completions; final_answer_match through rollout.score
under Qwen2.5's and Llama-3.1's tool templates.
"""
import itertools
import math
import os
import random
import re
import sys
import time
from decimal import Decimal
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib.chat import load_template
from lib.envs import Calculator, QwenTools
from lib.multiturn import episodes
from lib.tokenizer import get_tokenizer
from lib.tools import TOOLS
from reward import (EQUATION, LINE_BREAKS, NUMBER, REWARD_FNS, SPACES, compute_rewards,
                    countdown_equation, countdown_reward, exact_match, extract_answer,
                    final_answer_match, format_reward, get_reward_fns, last_boxed, numeric_match,
                    pass_at_k, soft_overlong_punishment, spell_operators, to_number)
from rollout import last_turn_start, score

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

def test_to_number():
    assert to_number("42") == 42 and to_number(" -3.50 ") == -3.5 and to_number("1,234.5") == 1234.5
    assert to_number(".5") == 0.5
    for text in ["", "4 2", "42 apples", "1e5", "nan", "inf", "-", "1."]:
        assert to_number(text) is None, text

def test_to_number_is_exact():
    """Numbers as written, not as floats: in float64 the first two pairs are equal."""
    assert to_number("12345678901234567") != to_number("12345678901234568")
    assert to_number("1.0000000000000001") != to_number("1")
    assert to_number("1,234.50") == to_number("1234.5") == Decimal("1234.5")
    assert to_number("-0") == to_number("0.000") and to_number("007") == 7
    # past int()'s 4,300 digits: a policy's text never raises
    many = "9" * 100_000
    assert to_number(many) == to_number(many + ".0") != to_number("1" + many)

def test_exact_match():
    got = exact_match(["1+1="] * 4, ["2", " 2\n", "02", "2 2"], answer=["2"] * 4, truncated=[False] * 4)
    assert got == [1.0, 1.0, 0.0, 0.0]

def test_numeric_match():
    completions = ["So the total is $1,234.", "12 apples, then 13", "no idea", "x = -3.50", "5", "5",
                   "Total: \\boxed{1,234.50} (check: 1234.5 - 34.5 = 1200)", "#### 7\nthat is, 3 + 4"]
    answers = ["1234", "12", "7", "-3.5", "5.0", "five", "1234.5", "7"]
    assert numeric_match([""] * 8, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, 1.0, None, 1.0, 1.0]

def test_numeric_match_is_exact():
    """No float tolerance: an answer off by one in the 17th digit is wrong (the old float64
    comparison scored it 1.0), one written with other zeros or commas is right."""
    completions = ["12345678901234567", "#### 0.30", "\\boxed{1,000,000.000}",
                   "x = 1.0000000000000001"]
    answers = ["12345678901234568", ".3", "1000000", "1"]
    assert numeric_match([""] * 4, completions, answer=answers) == [0.0, 1.0, 1.0, 0.0]

@pytest.mark.parametrize("text, boxed", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{\\frac{3}{4}} is it", "\\frac{3}{4}"),  # nested braces
    ("\\boxed{1} or rather \\boxed{2}", "2"),  # the last one
    ("\\boxed{}", ""),
    ("\\boxed{1} then \\boxed{2", None),  # the last one never closes: no boxed answer
    ("\\boxed 2", None),
    ("no box", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed

@pytest.mark.parametrize("text, value", [
    ("#### 42", 42),
    ("so the answer is \\boxed{42}.", 42),
    ("48 / 2 = 24, and 24 + 18 = 42", 42),  # no marker: the last number
    ("#### 42\nthat is \\boxed{41}", 42),  # a '#### N' line wins over a box
    ("\\boxed{41}\n####  $1,000.", 1000),
    ("####-3", -3),
    ("#### Step 2: add 5 apples\nso \\boxed{7}", 7),  # a markdown heading is not an answer line
    ("#### 42 apples, then 1 more", 1),  # nor is a '####' line with more than the number
    ("#### 3/4", 4),
    ("\\boxed{\\$1,000}", 1000),
    ("\\boxed{1{,}000}", 1000),  # LaTeX's thousands separator
    ("\\boxed{18 \\text{ dollars}}", 18),
    ("\\boxed{x = -3}", -3),
    ("\\boxed{0.5}", 0.5),
    ("\\boxed{.5}", 0.5),
    ("\\boxed{5} at first, but \\boxed{7}", 7),
    ("\\boxed{3/4}", None),  # a box holds the declared answer: not one number, so no answer
    ("\\boxed{\\frac{3}{4}}", None),
    ("\\boxed{2 + 3 = 5}", None),
    ("\\boxed{}", None),
    ("\\boxed{42", 42),  # never closed: no box, so the last number
    ("It costs $1,234.50.", 1234.5),
    ("She pays $18.", 18),
    ("It drops to -3 degrees", -3),
    ("x = 10-7", 7),  # a '-' after a digit is a subtraction
    ("x = (10)-7", 7),
    ("it is 3/4", 4),  # fractions are not evaluated: GSM8K's answers are whole numbers
    ("no idea", None),
    ("", None),
])
def test_extract_answer(text, value):
    assert extract_answer(text) == value

# the plain ways to read numbers, equation lines and boxes: they backtrack (quadratic on a long
# text), but they are exact references on short random ones
REFERENCE_NUMBER = re.compile(r"(?:(?<![\d)])-)?[\d,]*\.?\d+")
REFERENCE_BOXED = re.compile(r"(?s).*\\boxed\{.+\}.*")

def reference_equation(text):
    """countdown_equation a line at a time, as str.splitlines splits them."""
    box = last_boxed(text)
    if box is not None:
        return spell_operators(box).strip()
    lines = [spell_operators(line).strip() for line in text.splitlines()]
    return next((line for line in reversed(lines)
                 if EQUATION.fullmatch(line) and re.search(r"[-+*/]", line)), None)

def random_texts(pieces, n=20_000):
    rng = random.Random(0)
    return ["".join(rng.choices(pieces, k=rng.randint(0, 14))) for _ in range(n)]

def test_numbers_are_read_as_the_backtracking_regex_reads_them():
    for text in random_texts(list("0123456789,.-)$# x\n")):
        assert NUMBER.findall(text) == REFERENCE_NUMBER.findall(text), text
        assert bool(NUMBER.fullmatch(text)) == bool(REFERENCE_NUMBER.fullmatch(text)), text

def test_equations_are_read_as_line_by_line():
    pieces = list("12+-*/()= x\t\r\n\v") + ["\\times", "×", "−", "\\boxed{", "}", "\u2028",
                                           "\x1c", "\x1f", "\xa0", "\u3000", "\u200b"]
    for text in random_texts(pieces):
        assert countdown_equation(text) == reference_equation(text), text

def test_boxed_is_the_regex():
    (boxed,) = get_reward_fns("boxed")
    for text in random_texts(["\\boxed{", "\\boxed", "{", "}", "x", "\n"]):
        assert boxed([""], [text]) == [float(REFERENCE_BOXED.fullmatch(text) is not None)], text

def test_line_breaks_and_spaces_are_pythons():
    """LINE_BREAKS are where str.splitlines breaks a line, SPACES (a regex class) the rest of the
    whitespace (str.isspace, which is re's \\s), over every code point."""
    every = "".join(map(chr, range(sys.maxunicode + 1)))
    spaces = list(filter(str.isspace, every))
    breaks = [c for c in spaces if len(f"a{c}b".splitlines()) == 2]
    assert len(every.splitlines()) == len(breaks) + 1 and sorted(LINE_BREAKS) == breaks
    assert re.findall(f"[{SPACES}]", every) == [c for c in spaces if c not in breaks]
    assert re.findall(r"\s", every) == spaces

def test_format_reward():
    fn = format_reward()
    assert fn.__name__ == "format"
    assert fn([""] * 5, ["so it is 42", "42\n", "42 apples", "", "1\n2"]) == [1.0, 1.0, 0.0, 0.0, 1.0]
    boxed = format_reward(r"(?s).*\\boxed\{.+\}", name="boxed")
    assert boxed.__name__ == "boxed"
    assert boxed(["", ""], ["thus \\boxed{3}", "3"]) == [1.0, 0.0]
    (boxed,) = get_reward_fns("boxed")  # the built-in one: a box with something in it, anywhere
    completions = ["\\boxed{42}", "$\\boxed{\\frac{3}{4}}$, I think", "\\boxed{44 + 19}", "\\boxed{}", "42"]
    assert boxed([""] * 5, completions) == [1.0, 1.0, 1.0, 0.0, 0.0]

# (completion, numbers, target, reward)
COUNTDOWN = [
    ("\\boxed{44 + 19 + 35}", [44, 19, 35], 98, 1.0),
    ("So: \\boxed{ (44+19)\n+35 }.", [44, 19, 35], 98, 1.0),  # spaces and line breaks anywhere
    ("\\boxed{35 + 19 + 44 = 98}", [44, 19, 35], 98, 1.0),  # '= target' may follow
    ("\\boxed{44 + 19 + 35 = 97}", [44, 19, 35], 98, 0.0),  # but it must be the target
    ("\\boxed{98 = 44 + 19 + 35}", [44, 19, 35], 98, 0.0),  # on the right
    ("\\boxed{44 + 19 = 63 + 35 = 98}", [44, 19, 35], 98, 0.0),  # a chain of steps is not an equation
    ("\\boxed{44 + 19 + 35 + 0}", [44, 19, 35], 98, 0.0),  # an extra number
    ("\\boxed{44 + 54}", [44, 19, 35], 98, 0.0),  # a missing one
    ("\\boxed{44 + 44 + 10}", [44, 19, 35], 98, 0.0),
    ("\\boxed{19 + 19 + 60}", [19, 19, 60], 98, 1.0),  # a repeated number, used as often as given
    ("\\boxed{19 + 60 + 19 + 19 - 19}", [19, 19, 60], 98, 0.0),  # but not more often
    ("\\boxed{44 + 2}", [4, 4, 2], 46, 0.0),  # digits are not numbers: no concatenation
    ("\\boxed{8 / (3 - 8 / 3)}", [3, 3, 8, 8], 24, 1.0),  # exact: in floats this is 23.99999999999999
    ("\\boxed{8 / 3 * 3 - 5}", [8, 3, 3, 5], 3, 1.0),
    ("\\boxed{8 / 3 + 5}", [8, 3, 5], 7, 0.0),  # 7.67
    ("\\boxed{3 / (5 - 5)}", [3, 5, 5], 1, 0.0),  # division by zero
    ("\\boxed{(44 + 19 + 35}", [44, 19, 35], 98, 0.0),  # unbalanced parentheses
    ("\\boxed{44 + 19) + 35}", [44, 19, 35], 98, 0.0),
    ("\\boxed{(44 + 19 + 35))}", [44, 19, 35], 98, 0.0),
    ("\\boxed{()44 + 19 + 35}", [44, 19, 35], 98, 0.0),
    ("\\boxed{44 19 + 35}", [44, 19, 35], 54, 0.0),  # two numbers with no operation between them
    ("\\boxed{44 + 19 + 35 +}", [44, 19, 35], 98, 0.0),
    ("\\boxed{2 ** 3 * 1}", [2, 3, 1], 8, 0.0),  # no powers, in either spelling
    ("\\boxed{2 ^ 3 * 1}", [2, 3, 1], 8, 0.0),
    ("\\boxed{44 - 19 + 35}", [44, 19, 35], 60, 1.0),
    ("\\boxed{-19 + 44 + 35}", [44, 19, 35], 60, 0.0),  # no unary sign
    ("\\boxed{44 + (-19) + 35}", [44, 19, 35], 60, 0.0),
    ("\\boxed{44.0 + 19 + 35}", [44, 19, 35], 98, 0.0),  # whole numbers only
    ("\\boxed{__import__('os').system('44 + 19 + 35')}", [44, 19, 35], 98, 0.0),  # code is text, never run
    ("\\boxed{eval('44+19+35')}", [44, 19, 35], 98, 0.0),
    ("\\boxed{(lambda: 98)()}", [44, 19, 35], 98, 0.0),
    ("\\boxed{\\left(44 + 19\\right) + 35}", [44, 19, 35], 98, 0.0),  # letters
    ("\\boxed{٤٤ + 19 + 35}", [44, 19, 35], 98, 0.0),  # only ASCII digits
    ("\\boxed{6 × 4 ÷ 3}", [6, 4, 3], 8, 1.0),  # the usual other spellings of * / -
    ("\\boxed{6 \\times 4 \\div 3}", [6, 4, 3], 8, 1.0),
    ("\\boxed{(6 − 4) \\cdot 3}", [6, 4, 3], 6, 1.0),
    ("\\boxed{6 · 4 − 3 = 21}", [6, 4, 3], 21, 1.0),
    ("\\boxed{6 x 4 / 3}", [6, 4, 3], 8, 0.0),  # but not the letter x
    ("\\boxed{44 + 19} no wait: \\boxed{44 + 19 + 35}", [44, 19, 35], 98, 1.0),  # the last box wins
    ("\\boxed{44 + 19 + 35} no wait: \\boxed{44 + 19}", [44, 19, 35], 98, 0.0),
    ("\\boxed{44 + 19 + 35} and then \\boxed{44", [44, 19, 35], 98, 0.0),  # an unclosed last box: no answer
    ("\\boxed{}", [44, 19, 35], 98, 0.0),
    ("Let me try.\n44 + 19 + 35 = 98\nThat works!", [44, 19, 35], 98, 1.0),  # no box: the last equation line
    ("44 + 19 = 63\n63 + 35 = 98", [44, 19, 35], 98, 0.0),  # which is the last step here, not the whole answer
    ("44 + 19 + 35\n98", [44, 19, 35], 98, 1.0),  # a line without an operation is not an equation
    ("The answer is 44 + 19 + 35.", [44, 19, 35], 98, 0.0),  # a line with words is not one either
    ("I cannot find one.", [44, 19, 35], 98, 0.0),
    ("", [44, 19, 35], 98, 0.0),
    ("\\boxed{" + "(" * 94 + "44" + ")" * 94 + " + 19 + 35}", [44, 19, 35], 98, 1.0),  # 200 characters: parsed
    ("\\boxed{" + "(" * 95 + "44" + ")" * 95 + " + 19 + 35}", [44, 19, 35], 98, 0.0),  # 202: too long to read
    ("\\boxed{" + "(" * 10**6 + "}", [44, 19, 35], 98, 0.0),
    ("(" * 10**6 + "44 + 19 + 35" + ")" * 10**6, [44, 19, 35], 98, 0.0),
]

@pytest.mark.parametrize("completion, numbers, target, reward", COUNTDOWN)
def test_countdown_reward(completion, numbers, target, reward):
    assert countdown_reward([""], [completion], [numbers], [target]) == [reward]

def test_countdown_in_a_batch():
    # as the rollout calls it: the table as one batch, `numbers` a column of lists, scores as it does row by row
    completions, numbers, target, expected = map(list, zip(*COUNTDOWN))
    _, per_function = compute_rewards([countdown_reward], [1.0], [""] * len(completions), completions,
                                      dict(numbers=numbers, target=target))
    assert per_function["countdown_reward"] == expected

def test_soft_overlong_punishment():
    # DAPO eq. 13 with L_max = 10, L_cache = 4: free up to 6 tokens, then -1/4 per token, -1 from 10 on
    expected = [0.0] * 7 + [-0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    ids = [[7] * n for n in range(13)]
    assert soft_overlong_punishment(cache_length=4)(None, None, ids, max_completion_length=10) == expected
    # an explicit L_max wins over the rollout's; the default L_cache is a fifth of L_max
    assert soft_overlong_punishment(4, max_completion_length=10)(None, None, ids, max_completion_length=99) == expected
    assert soft_overlong_punishment()(None, None, [[1] * 16, [1] * 18, [1] * 20], max_completion_length=20) == \
        [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="cache_length must be at least 1 token, got 0"):
        soft_overlong_punishment(0)
    with pytest.raises(ValueError, match=r"cache_length \(8\) must not exceed max_completion_length \(5\)"):
        soft_overlong_punishment(8)(None, None, [[1]], max_completion_length=5)

def test_get_reward_fns():
    fns = get_reward_fns(["exact_match", "format", "overlong", "boxed"])
    assert [fn.__name__ for fn in fns] == ["exact_match", "format", "overlong", "boxed"]
    assert get_reward_fns("numeric_match") == [numeric_match]
    assert get_reward_fns("countdown_reward") == [countdown_reward]
    with pytest.raises(ValueError, match="unknown reward function 'exact'; valid names: exact_match, final_answer_match, "
                                         "numeric_match, single_number, countdown_reward, format, boxed, overlong, "
                                         "'module:function' for your own, 'rm:DIR' or 'judge:PATH' for a model's"):
        get_reward_fns(["exact_match", "exact"])


def test_single_number():
    """What config/judge.py asks its judge, measured without it: exactly one number in the answer."""
    (fn,) = get_reward_fns("single_number")
    assert fn(["q"] * 6, ["56", "It is 56.", "7 x 8 = 56", "fifty-six", "1,000 exactly", "-3.5 and 2"]) == \
        [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]

def test_get_reward_fns_imports_module_functions(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def brevity(prompts, completions, **kw):\n"
                                            "    return [1.0 / (1 + len(c)) for c in completions]\nnot_fn = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (fn,) = get_reward_fns(["my_rewards:brevity"])
    assert fn(["p"], ["abc"]) == [0.25]
    with pytest.raises(ValueError, match="reward function 'my_rewards:nope' cannot be imported"):
        get_reward_fns(["my_rewards:nope"])
    with pytest.raises(ValueError, match="reward function 'no_such_module:f' cannot be imported"):
        get_reward_fns(["no_such_module:f"])
    with pytest.raises(ValueError, match="reward function 'my_rewards:not_fn' is a int, not a function"):
        get_reward_fns(["my_rewards:not_fn"])

# -----------------------------------------------------------------------------
# every built-in reward: its contract, linear time, and the last turn of a tool episode

# (reward, completion, its columns besides answer "42", reward): right, wrong, malformed, empty
CONTRACTS = [
    ("exact_match", " 42\n", {}, 1.0), ("exact_match", "43", {}, 0.0),
    # another spelling of the value is not the answer
    ("exact_match", "42.0", {}, 0.0), ("exact_match", "", {}, 0.0),
    # the last turn is scored, not the tool's output before it, nor an echo of it
    ("final_answer_match", "<6*7>42\n42", dict(last_turn="42"), 1.0),
    ("final_answer_match", "<6*7>42\n41", dict(last_turn="41"), 0.0),
    ("final_answer_match", "<6*7>42\n42\n42", dict(last_turn="42\n42"), 0.0),
    ("final_answer_match", "", dict(last_turn=""), 0.0),
    # no last_turn column (a caller other than the rollout): the whole completion
    ("final_answer_match", "42", dict(last_turn=None), 1.0),
    ("numeric_match", "so \\boxed{42}.", {}, 1.0), ("numeric_match", "#### 41", {}, 0.0),
    # a box that is not one number gives no answer; an answer that is not a number, no reward
    ("numeric_match", "\\boxed{6*7}", {}, 0.0),
    ("numeric_match", "42", dict(answer="forty-two"), None), ("numeric_match", "", {}, 0.0),
    ("single_number", "It is 42.", {}, 1.0), ("single_number", "6*7 = 42", {}, 0.0),
    ("single_number", "forty-two", {}, 0.0), ("single_number", "", {}, 0.0),
    ("countdown_reward", "\\boxed{(44 + 19) - 35}", {}, 1.0),
    ("countdown_reward", "\\boxed{44 + 19 + 35}", {}, 0.0),
    ("countdown_reward", "\\boxed{44 + 19 - }", {}, 0.0), ("countdown_reward", "", {}, 0.0),
    ("format", "so it is 42\n", {}, 1.0), ("format", "42 apples", {}, 0.0),
    ("format", "42.", {}, 0.0), ("format", "", {}, 0.0),
    ("boxed", "so \\boxed{42}", {}, 1.0), ("boxed", "so 42", {}, 0.0),
    ("boxed", "\\boxed{}", {}, 0.0), ("boxed", "", {}, 0.0),
    # completion_ids (here a token a character) against max_completion_length 10
    ("overlong", "x" * 8, {}, 0.0), ("overlong", "x" * 9, {}, -0.5),
    ("overlong", "x" * 11, {}, -1.0), ("overlong", "", {}, 0.0),
]

def reward_columns(completion, **given):
    """The columns of one completion as the rollout passes them, the row's answer 42 (a
    Countdown row's [44, 19, 35] -> 28); `given` overrides them, None leaves one out."""
    columns = dict(answer="42", numbers=[44, 19, 35], target=28, truncated=False,
                   completion_ids=[1] * len(completion), last_turn=completion)
    columns.update(given)
    rows = {k: [v] for k, v in columns.items() if v is not None}
    return dict(rows, max_completion_length=10)

def test_the_contracts_cover_every_built_in_reward():
    assert {name for name, *_ in CONTRACTS} == set(REWARD_FNS)

@pytest.mark.parametrize("name, completion, given, reward", CONTRACTS)
def test_contract(name, completion, given, reward):
    fn = REWARD_FNS[name]
    columns = reward_columns(completion, **given)
    _, per_function = compute_rewards([fn], [1.0], ["q"], [completion], columns)
    assert per_function[fn.__name__] == [reward]

# 100,000 characters of a unit (after a head) that makes a regex or a loop a line slow
UNITS = (",", "1", "-", ".", "#", " ", "\n", "{", "}", "(", "\\boxed{", "####\n", "#### ", "1,",
         "-1", "1.", "1 ", "1\n", "-\n", "1+", "1-", "1+1=", "\\times", "- x\n", "1" * 50 + "x\n",
         "-" * 50 + "x\n", "\\boxed{1}")
PATHOLOGICAL = [("", unit) for unit in UNITS] + [
    ("\\boxed{", "{"), ("\\boxed{", "{}"), ("\\boxed{", "1,"), ("#### ", " "), ("#### ", ","),
    ("####", "-"), ("1", ","), ("\\boxed{" * 3, "(")]

@pytest.mark.parametrize("head, unit", PATHOLOGICAL,
                         ids=[repr(head + unit)[:20] for head, unit in PATHOLOGICAL])
def test_every_built_in_reward_takes_linear_time(head, unit):
    """Under 50 ms for each reward function on one such completion (up to three tries, so
    that another process's time slice is not counted). A backtracking regex took seconds."""
    text = head + (unit * (100_000 // len(unit) + 1))[:100_000 - len(head)]
    columns = reward_columns(text)
    slow = {}
    for name, fn in REWARD_FNS.items():
        for _ in range(3):
            start = time.perf_counter()
            fn(["q"], [text], **columns)
            took = time.perf_counter() - start
            if took < 0.05:
                break
        else:
            slow[name] = f"{took * 1000:.0f} ms"
    assert not slow, slow

# a tool template, its tokenizer and the end of the policy's turn; 'none': the calculator's plain
# text, no template
TOOL_SETUPS = {"qwen2.5": ("qwen_tools/qwen2.5_template.jinja", "tiny-bpe-a", "<|im_end|>"),
               "llama3.1": ("chat_templates/llama3_1.jinja", "rm/llama", "<|eot_id|>"),
               "none": (None, "bytes", None)}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'

def tool_episode_reward(setup, answer):
    """final_answer_match through rollout.score on an episode asking 2+2: the policy calls the
    calculator, reads its '4' as the template writes it, then says `answer` and ends. The tokens
    and the mask as the sampler makes them: the observations' tokens are not the policy's."""
    template, tokenizer, end = TOOL_SETUPS[setup]
    enc = get_tokenizer(os.path.join(FIXTURES, tokenizer) if template else tokenizer)
    eos = enc.encode_single_token(end) if end else enc.eot_token
    env = QwenTools({"calculator": TOOLS["calculator"]}) if template else Calculator()
    cfg = SimpleNamespace(max_turns=4, eos_ids=[eos], system_prompt=None, chat_template_kwargs={},
                          environment=env, max_completion_length=400, num_generations=1,
                          template=template and load_template(os.path.join(FIXTURES, template)))
    row = {"prompt": "What is 2+2?", "answer": "4"}
    turns, record, _ = episodes(env, [row], 1, cfg, enc)
    ids = enc.encode_ordinary(CALL) + [eos] if template else enc.encode_ordinary("<2+2>")
    mask = [True] * len(ids)
    ids += turns(0, ids)
    mask += [False] * (len(ids) - len(mask))
    ids += enc.encode_ordinary(answer) + [eos]
    mask += [True] * (len(ids) - len(mask))
    assert turns(0, ids) is None and record[0]["observations"] == ["4" if template else "4\n"]
    rewards, *_ = score([row], torch.tensor([ids]), torch.tensor([mask]), cfg, enc,
                        [final_answer_match], [1.0], record=record)
    return rewards.tolist()

@pytest.mark.parametrize("setup", list(TOOL_SETUPS))
def test_final_answer_match_reads_the_policys_last_turn(setup):
    """Whatever the template writes around the tool's result: the old text search for the result
    began the last turn inside the template's markup (an honest '4' scored 0.0 under a template),
    and found an echo of the calculator's '4\\n' as the result (its '4\\n4' scored 1.0)."""
    assert tool_episode_reward(setup, "4") == [1.0]
    assert tool_episode_reward(setup, "4\n4") == [0.0]
    assert tool_episode_reward(setup, "The answer is 4.") == [0.0]

def test_last_turn_start():
    """After the last observation's token before the row's last counted one: one cut at the end of
    the row (truncated) leaves the turn before it the last."""
    T, F = True, False
    mask = torch.tensor([[T, T, F, F, T, T, F], [T, T, T, F, F, F, F], [T, F, T, F, F, T, F],
                         [F] * 7, [T, T, F, F, F, F, F]])
    assert last_turn_start(mask).tolist() == [4, 0, 5, 0, 0]

# -----------------------------------------------------------------------------
# compute_rewards

def batch(completions, **columns):
    """prompts, completions, columns as the rollout passes them."""
    n = len(completions)
    cols = {"answer": ["4"] * n, "completion_ids": [[1] * len(c) for c in completions], "max_completion_length": 8,
            "truncated": [False] * n}
    cols.update(columns)
    return ["2+2="] * n, completions, cols

def test_compute_rewards_weights_and_none():
    prompts, completions, columns = batch(["4", "5", "four"])
    def only_digits(prompts, completions, **kwargs):  # not applicable to spelled-out answers
        return [1.0 if c.isdigit() else None for c in completions]
    def never(prompts, completions, **kwargs):
        return [None] * len(completions)
    total, per_function = compute_rewards([exact_match, only_digits, never], [1.0, 0.5, 3.0], prompts, completions,
                                          columns)
    assert per_function == {"exact_match": [1.0, 0.0, 0.0], "only_digits": [1.0, 1.0, None], "never": [None] * 3}
    assert total == [1.5, 0.5, 0.0]
    total, _ = compute_rewards([never], [1.0], prompts, completions, columns)
    assert total == [None, None, None]

def test_compute_rewards_accepts_bools_and_numpy_like_reals():
    prompts, completions, columns = batch(["4", "5"])
    def passes(prompts, completions, answer, **kwargs):
        return [c == a for c, a in zip(completions, answer)]
    def half(prompts, completions, **kwargs):
        return [np.float32(0.5)] * len(completions)
    total, per_function = compute_rewards([passes, half], [2.0, 1.0], prompts, completions, columns)
    assert total == [2.5, 0.5] and all(type(v) is float for v in per_function["passes"] + per_function["half"])

def test_compute_rewards_weight_count():
    with pytest.raises(ValueError, match="2 reward functions but 1 weights; give one weight per function"):
        compute_rewards([exact_match, numeric_match], [1.0], *batch(["4"]))

def test_compute_rewards_duplicate_names():
    with pytest.raises(ValueError, match="two reward functions are named 'format'"):
        compute_rewards([format_reward(), format_reward(r"\d+")], [1.0, 1.0], *batch(["4"]))

def test_compute_rewards_misaligned_columns():
    with pytest.raises(ValueError, match="answer has 1 entries for 2 completions; they must align"):
        compute_rewards([exact_match], [1.0], *batch(["4", "5"], answer=["4"]))

def test_raising_function_names_the_completion():
    def parse_int(prompts, completions, **kwargs):
        return [float(int(c)) for c in completions]
    with pytest.raises(ValueError) as e:
        compute_rewards([parse_int], [1.0], *batch(["4", "x" * 200, "5"]))
    msg = str(e.value)
    assert msg.startswith("reward function parse_int raised ValueError: invalid literal for int() with base 10:")
    assert msg.endswith("on completion '" + "x" * 76 + "...")  # the repr, cut to 80 characters
    assert "\n" not in msg

def test_raising_only_on_the_batch():
    def one_at_a_time(prompts, completions, max_completion_length, **kwargs):  # the scalar column survives slicing
        if len(completions) != 1 or max_completion_length != 8:
            raise RuntimeError("batch too big")
        return [0.0]
    with pytest.raises(ValueError, match="reward function one_at_a_time raised RuntimeError: batch too big "
                                         "\\(\\S*test_reward.py:\\d+\\) on a batch of 2 completions \\(but on "
                                         "none of them alone\\), e.g. '4'"):
        compute_rewards([one_at_a_time], [1.0], *batch(["4", "5"]))

def test_missing_column_is_reported():
    prompts, completions, columns = batch(["4"])
    del columns["answer"]
    with pytest.raises(ValueError, match="reward function exact_match raised TypeError: .*'answer' on completion '4'"):
        compute_rewards([exact_match], [1.0], prompts, completions, columns)

def test_wrong_type_and_length():
    def as_tuple(prompts, completions, **kwargs):
        return tuple(1.0 for _ in completions)
    with pytest.raises(ValueError, match="reward function as_tuple returned a tuple, expected a list of 2 floats"):
        compute_rewards([as_tuple], [1.0], *batch(["4", "5"]))
    def skips_empty(prompts, completions, **kwargs):
        return [1.0 for c in completions if c]
    with pytest.raises(ValueError, match="reward function skips_empty returned 2 values for 3 completions; called "
                                         "alone on completion '' it does not return one value"):
        compute_rewards([skips_empty], [1.0], *batch(["4", "", "5"]))

@pytest.mark.parametrize("bad, shown", [("1.0", "'1.0' \\(a str\\)"), ([1.0], "\\[1.0\\] \\(a list\\)")])
def test_non_number(bad, shown):
    def fn(prompts, completions, **kwargs):
        return [1.0, bad]
    with pytest.raises(ValueError, match=f"reward function fn returned {shown} for completion '5'; a reward must be "
                                         f"a number or None"):
        compute_rewards([fn], [1.0], *batch(["4", "5"]))

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite(bad):
    def fn(prompts, completions, **kwargs):
        return [bad, 0.0]
    with pytest.raises(ValueError, match=f"reward function fn returned {bad} for completion '4'; a reward must be "
                                         f"finite"):
        compute_rewards([fn], [1.0], *batch(["4", "5"]))

# -----------------------------------------------------------------------------
# pass@k

def brute_pass_at_k(n, c, k):
    """Share of all k-subsets of n samples (c correct) holding at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)

def test_pass_at_k_matches_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)

def test_pass_at_k_large_n():
    assert pass_at_k(10000, 37, 1) == pytest.approx(37 / 10000, rel=1e-9)  # pass@1 is the plain success rate
    exact = 1 - math.comb(9000, 100) / math.comb(10000, 100)  # exact big-integer arithmetic as the reference
    assert pass_at_k(10000, 1000, 100) == pytest.approx(exact, rel=1e-9)

def test_pass_at_k_errors():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match=f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}"):
            pass_at_k(n, c, k)
