"""
Tools for multi-turn rollouts: an exact calculator, a sandboxed Python runner (lib/sandbox.py), and Qwen-style tool
calls turned into the observation shown to the model. What the model writes never raises: a failure is
"error: <what was wrong>".
"""
import functools
import json
import math
import operator
import re
from fractions import Fraction

from lib.sandbox import cut, python

# -----------------------------------------------------------------------------
# calculator: our own recursive-descent parser, so that no text the model wrote is ever evaluated by Python

MAX_EXPRESSION, MAX_DIGITS, MAX_EXPONENT, MAX_DEPTH = 200, 1000, 100, 50  # characters, digits, |n| in **, parens
_LIMIT = 10 ** MAX_DIGITS  # of every numerator and denominator, intermediate results included
_TOKEN = re.compile(r"\s*(?:([0-9]+\.?[0-9]*|\.[0-9]+)|(\*\*|//|[-+*/%()x×÷]))")  # ASCII digits only


def _tokens(text):
    tokens, pos, text = [], 0, text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            bad = len(text) - len(text[pos:].lstrip())
            raise ValueError(f"unexpected character {text[bad]!r} at position {bad}")
        tokens.append(m[1] or {"x": "*", "×": "*", "÷": "/"}.get(m[2], m[2]))
        pos = m.end()
    return tokens


_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
               "//": lambda a, b: Fraction(a // b), "%": operator.mod, "**": lambda a, b: a ** int(b)}


def _apply(op, a, b):
    if op in ("/", "//", "%") and b == 0 or op == "**" and a == 0 and b < 0:
        raise ValueError("division by zero")
    if op == "**" and (b.denominator != 1 or abs(b) > MAX_EXPONENT):
        raise ValueError(f"the exponent of ** must be an integer from {-MAX_EXPONENT} to {MAX_EXPONENT}, not "
                         f"{format_number(b)}")
    # a power is refused before it is computed: a 1000-digit number to the 100th power would take a while
    if op == "**" and (max(abs(a.numerator), a.denominator).bit_length() - 1) * abs(b) > _LIMIT.bit_length():
        raise ValueError(f"number too big (more than {MAX_DIGITS} digits)")
    value = _OPERATIONS[op](a, b)
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise ValueError(f"number too big (more than {MAX_DIGITS} digits)")
    return value


def _evaluate(tokens):
    """With Python's precedence: -2**2 is -4, 2**-1 is 1/2, 2**3**2 is 2**9, 1-2-3 is (1-2)-3."""
    stack = tokens[::-1]  # the next token last, for pop()

    def chain(level, depth):  # left-associative: a + b - c (level 0), a * b / c (level 1)
        operand = (lambda: chain(1, depth)) if level == 0 else (lambda: unary(depth))
        value = operand()
        while stack and stack[-1] in (("+", "-"), ("*", "/", "//", "%"))[level]:
            value = _apply(stack.pop(), value, operand())
        return value

    def unary(depth):
        token = stack.pop() if stack else None
        if token in ("-", "+"):
            return -unary(depth) if token == "-" else unary(depth)
        if token and token[0] in "0123456789.":
            value = Fraction(token)  # exact: 0.1 is 1/10, not a float
        elif token != "(":
            raise ValueError("unexpected end of expression" if token is None else f"unexpected {token!r}")
        elif depth >= MAX_DEPTH:
            raise ValueError(f"more than {MAX_DEPTH} nested parentheses")
        else:
            value = chain(0, depth + 1)
            if not stack or stack.pop() != ")":
                raise ValueError("missing ')'")
        return _apply(stack.pop(), value, unary(depth)) if stack and stack[-1] == "**" else value

    value = chain(0, 0)
    if stack:
        raise ValueError(f"unexpected {stack[-1]!r} after a complete expression")
    return value


def format_number(value):
    """An integer as one ('56088'), a number with a finite decimal expansion as a decimal ('0.125', '-2.5'), any
    other as a reduced fraction ('1/3', '-7/3'): always exact, never rounded."""
    if value.denominator == 1:
        return str(value.numerator)
    places, rest = 0, value.denominator  # places: the smallest k such that 10**k is a multiple of the denominator
    while math.gcd(rest, 10) > 1:
        places, rest = places + 1, rest // math.gcd(rest, 10)
    if rest != 1:  # a prime other than 2 and 5 divides the denominator: no finite decimal expansion
        return f"{value.numerator}/{value.denominator}"
    digits = str(abs(value.numerator) * 10 ** places // value.denominator).rjust(places + 1, "0")
    return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]


def calculator(expression):
    """The exact value of an arithmetic expression (numbers, + - * / // % **, parentheses, unary signs; 'x' and '×'
    for *, '÷' for /) as format_number writes it, or a one-line "error: ..." saying what is wrong."""
    if not isinstance(expression, str) or not expression.strip() or len(expression) > MAX_EXPRESSION:
        return f"error: the expression must be a non-empty string of at most {MAX_EXPRESSION} characters"
    try:
        return format_number(_evaluate(_tokens(expression)))
    except ValueError as e:
        return f"error: {e}"

# -----------------------------------------------------------------------------
# tool calls in Qwen's format: the assistant's turn ends with <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>


MAX_CALL = 20000  # characters of a tool call's JSON: json.loads' time and memory stay bounded


def parse_tool_call(text):
    """(name, arguments) of the last <tool_call> block of an assistant turn that ends with </tool_call>; raises
    ValueError saying what is wrong with it (call_tool shows that to the model)."""
    text = text.rstrip()
    start = text.rfind("<tool_call>")
    if start < 0 or not text.endswith("</tool_call>"):
        raise ValueError("no tool call: the text must end with <tool_call>{...}</tool_call>")
    body = text[start + len("<tool_call>"):-len("</tool_call>")]
    if len(body) > MAX_CALL:
        raise ValueError(f"the tool call is longer than {MAX_CALL} characters")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool call is not valid JSON: {e}") from None
    except RecursionError:  # json's parser recurses once per nested [ or {
        raise ValueError("the tool call's JSON is nested too deeply") from None
    if (not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["name"], str)
            or not isinstance(call["arguments"], dict)):
        raise ValueError('the tool call must be a JSON object {"name": "<tool name>", "arguments": {...}}')
    return call["name"], call["arguments"]


def call_tool(text, tools, max_output=2000):
    """The observation for the tool call ending `text`: tools[name][0](**arguments), tools mapping a name to
    (function, description in the OpenAI/Qwen function format), or "error: ..." saying what was wrong; at most
    max_output characters (and a line saying it was cut), whatever the text."""
    return cut(_call(text, tools), max_output)


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def _call(text, tools):
    try:
        name, arguments = parse_tool_call(text)
    except ValueError as e:
        return f"error: {e}"
    if name not in tools:
        return f"error: unknown tool {name[:100]!r}; the tools are: {', '.join(tools)}"
    function, description = tools[name]
    known = description["function"]["parameters"]["properties"]
    missing = [key for key in description["function"]["parameters"].get("required", []) if key not in arguments]
    unknown = [key for key in arguments if key not in known]
    if missing or unknown:
        return (f"error: {name} needs the argument {missing[0]!r}" if missing else
                f"error: {name} has no argument {unknown[0][:100]!r}; its arguments are: {', '.join(known)}")
    for key, value in arguments.items():  # JSON's true is no number here, though Python's True is an int
        kind = known[key].get("type")
        expected = _JSON_TYPES.get(kind)
        if expected and (not isinstance(value, expected) or isinstance(value, bool) and kind != "boolean"):
            return f"error: {name}'s argument {key!r} must be a JSON {kind}, not {type(value).__name__}"
    try:
        return str(function(**arguments))
    except Exception as e:  # the observation reports any failure of the tool: the rollout goes on
        return f"error: {name} failed: {type(e).__name__}: {e}"


def _tool(function, name, about, parameter, parameter_about):
    """(function, its description in the OpenAI/Qwen function format) for a tool of one string parameter."""
    return function, {"type": "function", "function": {"name": name, "description": about, "parameters": {
        "type": "object", "properties": {parameter: {"type": "string", "description": parameter_about}},
        "required": [parameter]}}}


def tool_set(sandbox="bwrap"):
    """The built-in tools, for call_tool, the python tool running in `sandbox`; their descriptions
    go to the chat template's `tools` (chat.tools_of) and promise only what that sandbox gives."""
    fenced = "no network, nothing kept between calls, " if sandbox == "bwrap" else ""
    return {"calculator": _tool(calculator, "calculator", "Evaluate an arithmetic expression exactly: numbers, + - * / "
                                "// % ** and parentheses. The result is an integer, a decimal or a reduced fraction "
                                "such as 1/3.", "expression", "e.g. (123 * 456) / 7"),
            "python": _tool(functools.partial(python, sandbox=sandbox), "python", f"Run a Python 3 program (standard "
                            f"library only, {fenced}5 s, 256 MB) and return what it prints.", "code",
                            "the program; print the results you need")}


TOOLS = tool_set()

