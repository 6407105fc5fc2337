"""
Tests for reward.py: each built-in reward function against hand-worked cases, the GSM8K answer extractor and the
Countdown verifier against tables of tricky answers, compute_rewards' weighting and every error it raises (the
message text included), and pass@k against a brute-force enumeration of subsets.
"""
import itertools
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from reward import (compute_rewards, countdown_reward, exact_match, extract_answer, format_reward, get_reward_fns,
                    last_boxed, numeric_match, pass_at_k, soft_overlong_punishment, to_number)

def test_to_number():
    assert to_number("42") == 42 and to_number(" -3.50 ") == -3.5 and to_number("1,234.5") == 1234.5
    assert to_number(".5") == 0.5
    for text in ["", "4 2", "42 apples", "1e5", "nan", "inf", "-", "1."]:
        assert to_number(text) is None, text

def test_exact_match():
    got = exact_match(["1+1="] * 4, ["2", " 2\n", "02", "2 2"], answer=["2"] * 4, truncated=[False] * 4)
    assert got == [1.0, 1.0, 0.0, 0.0]

def test_numeric_match():
    completions = ["So the total is $1,234.", "12 apples, then 13", "no idea", "x = -3.50", "5", "5",
                   "Total: \\boxed{1,234.50} (check: 1234.5 - 34.5 = 1200)", "#### 7\nthat is, 3 + 4"]
    answers = ["1234", "12", "7", "-3.5", "5.0", "five", "1234.5", "7"]
    assert numeric_match([""] * 8, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, 1.0, None, 1.0, 1.0]

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
