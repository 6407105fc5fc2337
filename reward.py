"""
Reward functions for RL on verifiable tasks, the code that calls and checks them, and
pass@k.

A reward function is a plain callable

    fn(prompts, completions, **columns) -> list of float or None

with one value per completion; None means "this function does not apply here" (e.g. a
numeric verifier on a row whose answer is not a number). `prompts` and `completions` are
aligned lists of strings; `columns` holds every dataset column as a list aligned with
them (e.g. `answer`) plus what the rollout knows: `completion_ids` (the sampled tokens,
no padding, the eos included if it was sampled), `max_completion_length` (one int for
the whole batch), `truncated` (hit the length limit without an eos) and `last_turn` (the
text of the policy's last turn: its tokens after the last observation of a multi-turn
row, the whole completion otherwise); a multi-turn rollout adds `observations` (each
row's, as the environment gave them). Take the columns you need by name and swallow the
rest with **kwargs. To add a reward, write such a function and add it to REWARD_FNS
below.

The built-in ones read the policy's text in linear time (no regex that backtracks on it:
a long completion never stalls the run) and compare numbers exactly, as written.
"""
import math
import numbers
import os
import re
import traceback
from decimal import Decimal
from fractions import Fraction

from lib.errors import ConfigError, import_named

# what the rollout passes to reward functions itself: no dataset column may be called so
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "max_completion_length",
                    "truncated", "last_turn", "observations")

# 42, -3.5, 1,234.5; a trailing '.' ends a sentence, it is not a decimal, and a '-'
# after a digit or ')' is a subtraction, not a sign: '10-7' ends on 7. A number never
# starts after a ',': a search that failed at a run of commas would fail at each of its
# commas again, each time reading the whole run (quadratic), and one that matched there
# took the rest of the run. The lookahead lets the regex engine skip to the characters a
# number can start with.
NUMBER = re.compile(r"(?=[-\d,.])(?:(?<![\d)])-)?(?<!,)[\d,]*\.?\d+")

def to_number(text):
    """The exact value of `text` if it is one number such as '-1,234.5' (commas
    ignored), else None. A Decimal, as written: '1,234.50' is 1234.5 and
    12345678901234567 is not 12345678901234568 (as floats they are equal). Not a
    Fraction: int() refuses more than 4,300 digits, a policy's text may hold more."""
    text = text.strip()
    return Decimal(text.replace(",", "")) if NUMBER.fullmatch(text) else None

# -----------------------------------------------------------------------------
# reading the final answer out of a completion

def last_boxed(text):
    r"""What the last '\boxed{' in `text` holds up to its matching brace
    ('\boxed{\frac{3}{4}}' -> '\frac{3}{4}'), or None if there is none or it is never
    closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    start, depth = start + len("\\boxed{"), 1
    for i in range(start, len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[start:i]
    return None

# a line that is only '#### 42', as GSM8K's own solutions end; not a markdown heading
# such as '#### Step 2: ...'
ANSWER_LINE = re.compile(r"^####[ \t]*\$?(" + NUMBER.pattern + r")[ \t]*\.?[ \t]*$",
                         re.MULTILINE)

def extract_answer(text):
    r"""The final answer of a math completion, exact (to_number), or None if it gives
    none: the number on the last '#### 42' line, else the number in the last \boxed{}
    (the form the GSM8K prompt asks for), else the last number in the text. Commas, '$'
    and a sentence's final '.' are not part of a number: '$1,234.50.' is 1234.5. A box
    is the model's declared answer, so it must hold exactly one number
    ('\boxed{\$1{,}000}', '\boxed{18 \text{ dollars}}'); one holding '3/4',
    '\frac{3}{4}' or '2+3=5' is an answer that is not a number, hence None, not a guess
    at one of its numbers. Fractions are not evaluated anywhere: GSM8K's answers are
    whole numbers."""
    lines = ANSWER_LINE.findall(text)
    if lines:
        return to_number(lines[-1])
    box = last_boxed(text)
    if box is not None:
        # '{,}' is LaTeX's thousands separator
        found = NUMBER.findall(box.replace("{,}", ","))
        return to_number(found[0]) if len(found) == 1 else None
    found = NUMBER.findall(text)
    return to_number(found[-1]) if found else None

# Countdown answers: the other ways models write the four operations, as + - * /
OPERATOR_SPELLINGS = {"\\times": "*", "\\cdot": "*", "\\div": "/",
                      "×": "*", "·": "*", "÷": "/", "−": "-"}
# all an answer may hold: no letters, '.' or '^'
EQUATION = re.compile(r"[0-9+\-*/()=\s]+")
# characters, ~8x a 4-number answer: the parser recurses ~600 frames at most
MAX_EQUATION = 200
# the characters str.splitlines breaks lines at, and the other whitespace (str.isspace),
# which stays within a line
LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
SPACES = "\t\x1f \xa0\u1680\u2000-\u200a\u202f\u205f\u3000"
# a whole line of EQUATION's characters with an operator in it: one regex over the text,
# not one a line in Python (a completion of 100,000 line breaks), tried at a line's
# start only, so that a failed try never reads more than its line
EQUATION_LINE = re.compile(f"(?<![^{LINE_BREAKS}])[0-9()={SPACES}]*[-+*/]"
                           f"[-+*/0-9()={SPACES}]*(?![^{LINE_BREAKS}])")

def spell_operators(text):
    """`text` with OPERATOR_SPELLINGS' operators as + - * /."""
    for other, op in OPERATOR_SPELLINGS.items():
        text = text.replace(other, op)
    return text

def countdown_equation(text):
    r"""The equation a Countdown completion answers with, operators spelled + - * /:
    what its last \boxed{} holds, else its last line of EQUATION's characters with an
    operator in it, else None; stripped of the whitespace around it."""
    box = last_boxed(text)
    if box is not None:
        return spell_operators(box).strip()
    lines = EQUATION_LINE.findall(spell_operators(text))
    return lines[-1].strip() if lines else None

def _evaluate(tokens):
    """The exact value of `tokens` (whole numbers, + - * / and parentheses, the usual
    precedence) as a Fraction, or None if they are not such an expression or it divides
    by zero. A recursive-descent parser: a model's text is never handed to eval. There
    is no unary sign: the numbers are positive and the operations binary, so '-3' is not
    a move the puzzle has."""
    tokens, pos = tokens + ["end"], 0
    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]
    def operand():
        token = take()
        if token.isdigit():
            return Fraction(int(token))
        if token != "(":
            raise ValueError
        value = expression()
        if take() != ")":
            raise ValueError
        return value
    def term():
        value = operand()
        while tokens[pos] in ("*", "/"):
            value = value * operand() if take() == "*" else value / operand()
        return value
    def expression():
        value = term()
        while tokens[pos] in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value
    try:
        value = expression()
    except (ValueError, ZeroDivisionError):
        return None
    return value if tokens[pos] == "end" else None

def solves_countdown(equation, numbers, target):
    """Whether `equation` ('(44 + 19) - 35', '... = 28' also fine) uses each of
    `numbers` exactly once, as written ('4' and '4' may not be joined into '44'), and
    equals `target` exactly: '8 / 3 * 3' is 8."""
    if len(equation) > MAX_EQUATION or not EQUATION.fullmatch(equation):
        return False
    expression, _, claimed = equation.partition("=")
    # a stated result must be the target: '= 30 = 28' is not
    if claimed and claimed.strip() != str(target):
        return False
    tokens = re.findall(r"[0-9]+|\S", expression)
    if sorted(int(t) for t in tokens if t.isdigit()) != sorted(numbers):
        return False
    return _evaluate(tokens) == target

# -----------------------------------------------------------------------------
# built-in reward functions

def exact_match(prompts, completions, answer, **kwargs):
    """1.0 if the completion is the answer (whitespace around it aside), else 0.0."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

def final_answer_match(prompts, completions, answer, last_turn=None, **kwargs):
    """exact_match on the policy's last turn (the column last_turn: the answer it gives
    after its tool calls, whatever a chat template writes around their results), the
    whole completion where there is no such column."""
    return exact_match(prompts, completions if last_turn is None else last_turn, answer)

def numeric_match(prompts, completions, answer, **kwargs):
    """1.0 if the completion's final answer (extract_answer) has the answer's value
    exactly, else 0.0; None where the answer is not a number. 'The total is $1,000.'
    matches '1000', '0.30' matches '.3', no tolerance: '12345678901234567' does not
    match '12345678901234568'."""
    return [None if to_number(a) is None else float(extract_answer(c) == to_number(a))
            for c, a in zip(completions, answer)]

def countdown_reward(prompts, completions, numbers, target, **kwargs):
    """1.0 if the completion's equation (countdown_equation) solves the Countdown
    problem (solves_countdown) with the row's `numbers` (a list of ints) and `target`
    (an int), else 0.0."""
    rewards = []
    for c, nums, t in zip(completions, numbers, target):
        equation = countdown_equation(c)
        solved = equation is not None and solves_countdown(equation, nums, t)
        rewards.append(float(solved))
    return rewards

def single_number(prompts, completions, **kwargs):
    """1 if the completion states exactly one number, else 0: a property a judge can be
    asked about (config/judge.py), measured here without one."""
    return [float(len(NUMBER.findall(c)) == 1) for c in completions]

# the completion ends on its answer, no rambling after it
ENDS_WITH_NUMBER = r"(?s).*\d\s*"

def format_reward(pattern=ENDS_WITH_NUMBER, name="format"):
    """A reward function, `name` in the logs, giving 1.0 to completions that match
    `pattern` in full, else 0.0. Weighted small, it nudges the policy toward a shape the
    verifier can read."""
    regex = re.compile(pattern)
    def fn(prompts, completions, **kwargs):
        return [float(regex.fullmatch(c) is not None) for c in completions]
    fn.__name__ = name
    return fn

def boxed(prompts, completions, **kwargs):
    r"""1.0 if the completion has a \boxed{ with something in it and a '}' after that,
    else 0.0: the GSM8K and Countdown prompts ask for the answer in a \boxed{}, a reward
    for doing so, whatever the box holds. The first box and the last '}' tell, in linear
    time (as a regex, '.*\\boxed\{.+\}.*' backtracks from every box to the end of the
    text)."""
    rewards = []
    for c in completions:
        start = c.find("\\boxed{")
        rewards.append(float(start >= 0 and c.rfind("}") > start + len("\\boxed{")))
    return rewards

def soft_overlong_punishment(cache_length=None, max_completion_length=None):
    """DAPO's soft overlong punishment as a reward function: no penalty up to
    L_max - L_cache tokens, then a penalty growing linearly to -1 at L_max tokens, and -1
    beyond. L_max defaults to the rollout's max_completion_length and L_cache to a fifth
    of it (DAPO used 4096 of 20480); lengths count the eos if sampled."""
    if cache_length is not None and cache_length < 1:
        raise ConfigError(f"cache_length must be at least 1 token, got {cache_length}")
    def overlong(prompts, completions, completion_ids, **columns):
        l_max = (columns["max_completion_length"] if max_completion_length is None
                 else max_completion_length)
        l_cache = max(1, l_max // 5) if cache_length is None else cache_length
        if l_cache > l_max:
            raise ConfigError(f"cache_length ({l_cache}) must not exceed "
                              f"max_completion_length ({l_max})")
        # DAPO (Yu et al. 2025) eq. 13: R(y) = 0 if |y| <= L_max - L_cache,
        # ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max,
        # and -1 if |y| > L_max
        return [max(-1.0, min(0.0, (l_max - l_cache - len(ids)) / l_cache))
                for ids in completion_ids]
    return overlong

REWARD_FNS = {  # the names a config can use in its list of reward functions
    "exact_match": exact_match,
    "final_answer_match": final_answer_match,
    "numeric_match": numeric_match,
    "single_number": single_number,
    "countdown_reward": countdown_reward,
    "format": format_reward(),
    "boxed": boxed,
    "overlong": soft_overlong_punishment(),
}

def get_reward_fns(names):
    """The reward functions called `names` (a single name is fine too): a key of
    REWARD_FNS, or 'module:function' for one of your own, imported from the Python path
    (e.g. --reward_funcs="('myrewards:brevity',)")."""
    fns = []
    for name in [names] if isinstance(names, str) else names:
        if ':' in name:
            fn = import_named(name, 'reward function')
            if not callable(fn):
                raise ConfigError(f"reward function {name!r} is a {type(fn).__name__}, "
                                  f"not a function")
        elif name in REWARD_FNS:
            fn = REWARD_FNS[name]
        else:
            raise ConfigError(f"unknown reward function {name!r}; valid names: "
                              f"{', '.join(REWARD_FNS)}, 'module:function' for your own, "
                              f"'rm:DIR' or 'judge:PATH' for a model's")
        fns.append(fn)
    return fns

# -----------------------------------------------------------------------------
# calling reward functions, with errors that say which function and which completion

def _show(completion):
    """A completion for an error message: repr (one line), cut to ~80 characters."""
    r = repr(completion)
    return r if len(r) <= 80 else r[:77] + "..."

def _one_line(error):
    """The error and, where the function raised it (not the call: a missing argument), its
    traceback's last frame: the user's line of code."""
    frames = traceback.extract_tb(error.__traceback__)
    # relative where it is under the working directory: shorter
    here = os.path.relpath(frames[-1].filename)
    file = frames[-1].filename if here.startswith("..") else here
    where = f" ({file}:{frames[-1].lineno})" if len(frames) > 1 else ""
    return f"{type(error).__name__}: {' '.join(str(error).split())}{where}"

def _culprit(fn, prompts, completions, columns):
    """Call fn on one completion at a time to find the first it raises on or does not
    give exactly one value for: (completion, exception or None), or (None, None) if only
    the batch fails."""
    for i, c in enumerate(completions):
        # the columns of completion i alone; scalars (max_completion_length) as they are
        row = {k: v[i:i + 1] if isinstance(v, list) else v for k, v in columns.items()}
        try:
            values = fn(prompts[i:i + 1], [c], **row)
        except Exception as e:
            return c, e
        if not isinstance(values, list) or len(values) != 1:
            return c, None
    return None, None

def _fail(fn, prompts, completions, columns, values=None, error=None):
    """Raise the ConfigError that says what fn did wrong: it raised `error`, or returned
    `values` that are not one finite number (or None) per completion. Called only then:
    it calls fn on one completion at a time to name the culprit."""
    name, n = fn.__name__, len(completions)
    if error is not None:
        culprit, its_error = _culprit(fn, prompts, completions, columns)
        if its_error is None:
            raise ConfigError(f"reward function {name} raised {_one_line(error)} on a batch "
                              f"of {n} completions (but on none of them alone), "
                              f"e.g. {_show(completions[0])}") from error
        raise ConfigError(f"reward function {name} raised {_one_line(its_error)} "
                          f"on completion {_show(culprit)}") from its_error
    if not isinstance(values, list):
        raise ConfigError(f"reward function {name} returned a {type(values).__name__}, "
                          f"expected a list of {n} floats (or None), one per completion, "
                          f"e.g. for {_show(completions[0])}")
    if len(values) != n:
        culprit, _ = _culprit(fn, prompts, completions, columns)
        where = (f"; called alone on completion {_show(culprit)} it does not return one "
                 f"value" if culprit is not None else "")
        raise ConfigError(f"reward function {name} returned {len(values)} values "
                          f"for {n} completions{where}")
    for v, c in zip(values, completions):
        if v is not None and not isinstance(v, numbers.Real):
            raise ConfigError(f"reward function {name} returned {_show(v)} (a "
                              f"{type(v).__name__}) for completion {_show(c)}; a reward "
                              f"must be a number or None")
        if v is not None and not math.isfinite(v):
            raise ConfigError(f"reward function {name} returned {v} for completion "
                              f"{_show(c)}; a reward must be finite")

def compute_rewards(reward_fns, weights, prompts, completions, columns):
    """Score completions with every reward function. Returns (total, per_function):
    total[i] is the weighted sum over the functions that gave completion i a value, or
    None if none of them did (a function saying None is left out rather than counted as
    a 0 that would drag a mean down); per_function maps each function's __name__ to its
    raw, unweighted values, for logging."""
    if len(weights) != len(reward_fns):
        raise ConfigError(f"{len(reward_fns)} reward functions but {len(weights)} weights; "
                          f"give one weight per function")
    names = [fn.__name__ for fn in reward_fns]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"two reward functions are named {name!r}; "
                              f"give them distinct __name__s for the logs")
    for key, value in [("prompts", prompts)] + list(columns.items()):
        if isinstance(value, list) and len(value) != len(completions):
            raise ConfigError(f"{key} has {len(value)} entries for {len(completions)} completions; "
                              f"they must align")
    per_function = {}
    for fn in reward_fns:
        try:
            values = fn(prompts, completions, **columns)
        except Exception as e:
            _fail(fn, prompts, completions, columns, error=e)
        # one finite number (or None) per completion; bools count as 1.0/0.0, so a
        # verifier may return its pass/fail test as is
        if not (isinstance(values, list) and len(values) == len(completions) and all(
                v is None or isinstance(v, numbers.Real) and math.isfinite(v)
                for v in values)):
            _fail(fn, prompts, completions, columns, values=values)
        per_function[fn.__name__] = [None if v is None else float(v) for v in values]
    total = []
    for i in range(len(completions)):
        given = [w * values[i] for w, values in zip(weights, per_function.values())
                 if values[i] is not None]
        total.append(sum(given) if given else None)
    return total, per_function

# -----------------------------------------------------------------------------

def pass_at_k(n, c, k):
    """Unbiased estimate of pass@k from n samples of which c are correct (Chen et al.
    2021, the Codex paper): 1 - C(n-c, k) / C(n, k), the chance that k of the n samples
    drawn without replacement hold a correct one. The ratio is computed as a product, so
    it neither overflows nor loses precision for large n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # fewer than k wrong samples: every draw of k holds a correct one
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
