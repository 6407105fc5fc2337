"""
Reward functions for RL on verifiable tasks, the code that calls and checks them, and the pass@k estimator.

A reward function is a plain callable

    fn(prompts, completions, **columns) -> list of float or None

with one value per completion; None means "this function does not apply here" (e.g. a numeric verifier on a row
whose answer is not a number). `prompts` and `completions` are aligned lists of strings; `columns` holds every
dataset column as a list aligned with them (e.g. `answer`) plus what the rollout knows: `completion_ids` (the
sampled tokens, no padding, the eos included if it was sampled), `max_completion_length` (one int for the whole
batch) and `truncated` (hit the length limit without an eos). Take the columns you need by name and swallow the
rest with **kwargs. To add a reward, write such a function and add it to REWARD_FNS below.
"""
import importlib
import math
import numbers
import re

# names the rollout passes to reward functions itself, so a dataset column may not use them
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "max_completion_length", "truncated")

NUMBER = re.compile(r"-?[\d,]*\.?\d+")  # 42, -3.5, 1,234.5; a trailing '.' ends a sentence, it is not a decimal

def to_number(text):
    """The value of `text` if it is one number such as '-1,234.5' (commas ignored), else None."""
    text = text.strip()
    return float(text.replace(",", "")) if NUMBER.fullmatch(text) else None

# -----------------------------------------------------------------------------
# built-in reward functions

def exact_match(prompts, completions, answer, **kwargs):
    """1.0 if the completion is the answer up to surrounding whitespace, else 0.0 (the built-in tasks)."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

def numeric_match(prompts, completions, answer, **kwargs):
    """1.0 if the last number in the completion has the answer's value, else 0.0; None where the answer is not a
    number. 'The total is $1,000.' matches '1000': reasoning comes first, so the last number is the final answer."""
    rewards = []
    for c, a in zip(completions, answer):
        target, found = to_number(a), NUMBER.findall(c)
        rewards.append(None if target is None else float(bool(found) and to_number(found[-1]) == target))
    return rewards

ENDS_WITH_NUMBER = r"(?s).*\d\s*"  # the completion ends on its answer, no rambling after it

def format_reward(pattern=ENDS_WITH_NUMBER, name="format"):
    """A reward function giving 1.0 to completions that match `pattern` in full, else 0.0. Weighted small, it
    nudges the policy toward a shape the verifier can read. `name` is how it shows in the logs."""
    regex = re.compile(pattern)
    def fn(prompts, completions, **kwargs):
        return [float(regex.fullmatch(c) is not None) for c in completions]
    fn.__name__ = name
    return fn

def soft_overlong_punishment(cache_length=None, max_completion_length=None):
    """DAPO's soft overlong punishment as a reward function: no penalty up to L_max - L_cache tokens, then a
    penalty growing linearly to -1 at L_max tokens, and -1 beyond. L_max defaults to the rollout's
    max_completion_length and L_cache to a fifth of it (DAPO used 4096 of 20480). Lengths count the eos if sampled."""
    if cache_length is not None and cache_length < 1:
        raise ValueError(f"cache_length must be at least 1 token, got {cache_length}")
    def overlong(prompts, completions, completion_ids, **columns):
        l_max = columns["max_completion_length"] if max_completion_length is None else max_completion_length
        l_cache = max(1, l_max // 5) if cache_length is None else cache_length
        if l_cache > l_max:
            raise ValueError(f"cache_length ({l_cache}) must not exceed max_completion_length ({l_max})")
        # DAPO (Yu et al. 2025) eq. 13: R(y) = 0 if |y| <= L_max - L_cache,
        # ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max, and -1 if |y| > L_max
        return [max(-1.0, min(0.0, (l_max - l_cache - len(ids)) / l_cache)) for ids in completion_ids]
    return overlong

REWARD_FNS = {  # the names a config can use in its list of reward functions
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format": format_reward(),
    "overlong": soft_overlong_punishment(),
}

def get_reward_fns(names):
    """The reward functions called `names` (a single name is fine too): a key of REWARD_FNS, or 'module:function'
    for one of your own, imported from the Python path (e.g. --reward_funcs="('myrewards:brevity',)")."""
    fns = []
    for name in [names] if isinstance(names, str) else names:
        if ':' in name:
            module, _, attr = name.partition(':')
            try:
                fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"reward function {name!r} cannot be imported ({e}); put {module}.py on the "
                                 f"Python path (e.g. the directory you run from) with a function {attr}") from None
            if not callable(fn):
                raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a function")
        elif name in REWARD_FNS:
            fn = REWARD_FNS[name]
        else:
            raise ValueError(f"unknown reward function {name!r}; valid names: {', '.join(REWARD_FNS)}, "
                             f"or 'module:function' for your own")
        fns.append(fn)
    return fns

# -----------------------------------------------------------------------------
# calling reward functions, with errors that say which function and which completion

def _show(completion):
    """A completion for an error message: repr (so it stays on one line), cut to ~80 characters."""
    r = repr(completion)
    return r if len(r) <= 80 else r[:77] + "..."

def _one_line(error):
    return f"{type(error).__name__}: {' '.join(str(error).split())}"

def _culprit(fn, prompts, completions, columns):
    """Call fn on one completion at a time to find the first it raises on or does not give exactly one value.
    Returns (completion, exception or None), or (None, None) if it only misbehaves on the whole batch."""
    for i, c in enumerate(completions):
        row = {k: v[i:i + 1] if isinstance(v, list) else v for k, v in columns.items()}  # scalars stay as they are
        try:
            values = fn(prompts[i:i + 1], [c], **row)
        except Exception as e:
            return c, e
        if not isinstance(values, list) or len(values) != 1:
            return c, None
    return None, None

def _call(fn, prompts, completions, columns):
    """fn's rewards as floats or None, after checking that there is one finite number (or None) per completion.
    Bools are accepted as 1.0/0.0, so a verifier may return its pass/fail test directly."""
    name, n = fn.__name__, len(completions)
    try:
        values = fn(prompts, completions, **columns)
    except Exception as e:
        c, e_one = _culprit(fn, prompts, completions, columns)
        if e_one is None:
            raise ValueError(f"reward function {name} raised {_one_line(e)} on a batch of {n} completions "
                             f"(but on none of them alone), e.g. {_show(completions[0])}") from e
        raise ValueError(f"reward function {name} raised {_one_line(e_one)} on completion {_show(c)}") from e_one
    if not isinstance(values, list):
        raise ValueError(f"reward function {name} returned a {type(values).__name__}, expected a list of {n} floats "
                         f"(or None), one per completion, e.g. for {_show(completions[0])}")
    if len(values) != n:
        c, _ = _culprit(fn, prompts, completions, columns)
        where = f"; called alone on completion {_show(c)} it does not return one value" if c is not None else ""
        raise ValueError(f"reward function {name} returned {len(values)} values for {n} completions{where}")
    for v, c in zip(values, completions):
        if v is not None and not isinstance(v, numbers.Real):
            raise ValueError(f"reward function {name} returned {_show(v)} (a {type(v).__name__}) for completion "
                             f"{_show(c)}; a reward must be a number or None")
        if v is not None and not math.isfinite(v):
            raise ValueError(f"reward function {name} returned {v} for completion {_show(c)}; a reward must be finite")
    return [None if v is None else float(v) for v in values]

def compute_rewards(reward_fns, weights, prompts, completions, columns):
    """Score completions with every reward function. Returns (total, per_function):
    total[i] is the weighted sum over the functions that gave completion i a value, or None if none of them did
    (a function saying None is left out rather than counted as a 0 that would drag a mean down); per_function
    maps each function's __name__ to its raw, unweighted values, for logging."""
    if len(weights) != len(reward_fns):
        raise ValueError(f"{len(reward_fns)} reward functions but {len(weights)} weights; give one weight per function")
    names = [fn.__name__ for fn in reward_fns]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two reward functions are named {name!r}; give them distinct __name__s for the logs")
    for key, value in [("prompts", prompts)] + list(columns.items()):
        if isinstance(value, list) and len(value) != len(completions):
            raise ValueError(f"{key} has {len(value)} entries for {len(completions)} completions; they must align")
    per_function = {fn.__name__: _call(fn, prompts, completions, columns) for fn in reward_fns}
    total = []
    for i in range(len(completions)):
        given = [w * values[i] for w, values in zip(weights, per_function.values()) if values[i] is not None]
        total.append(sum(given) if given else None)
    return total, per_function

# -----------------------------------------------------------------------------

def pass_at_k(n, c, k):
    """Unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, the Codex paper):
    1 - C(n-c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold a correct one.
    The ratio is computed as a product, so it neither overflows nor loses precision for large n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # fewer than k wrong samples: every draw of k holds a correct one
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
