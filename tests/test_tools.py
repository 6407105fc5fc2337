"""
Tests for lib/tools.py and the tool rendering of lib/chat.py: the calculator against Python's own exact Fraction arithmetic
(random expressions, and the refusals, during which eval, exec and compile must not be called); the Python sandbox
(output, crashes, timeouts, memory, output floods, fork bombs, the uid drop, the environment, the network); Qwen-style
tool calls and their "error: ..." observations; and apply_chat_template(..., tools=...) and
chat.tool_turn against Qwen2.5-Instruct's own template, rendered with jinja2 into
tests/fixtures/qwen_tools/reference.json by make_reference.py, and against hand-written strings.
"""
import builtins
import json
import os
import random
import re
import shutil
import tempfile
import time
from decimal import Decimal, localcontext
from fractions import Fraction

import pytest

from lib.chat import apply_chat_template, load_template, prompt_messages, tool_turn
from lib.sandbox import MAX_OUTPUT_MB, interpreter, python, sandbox_problem
from lib.tools import TOOLS, calculator, call_tool, parse_tool_call

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "qwen_tools")
with open(os.path.join(FIXTURE, "reference.json"), encoding="utf-8") as f:
    REF = json.load(f)["cases"]

# -----------------------------------------------------------------------------
# calculator

def exact(value):
    """How calculator writes a number, worked out another way: Decimal's exact division for a finite expansion."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    with localcontext() as ctx:
        ctx.prec = 5000
        return format(Decimal(value.numerator) / Decimal(value.denominator), "f")

def random_expression(rng, depth=0):
    """Text with Python's syntax for these operators, and spaces here and there."""
    r = rng.random()
    if depth > 3 or r < 0.3:
        number = rng.choice([str(rng.randint(0, 999)), f"{rng.randint(0, 99)}.{rng.randint(0, 99)}",
                             str(rng.randint(0, 9)), f".{rng.randint(1, 9)}"])
        return ("-" if rng.random() < 0.15 else "") + number
    if r < 0.4:
        return "(" + random_expression(rng, depth + 1) + ")"
    if r < 0.5:  # a power: a small integer exponent, signed sometimes, on an atom
        base = rng.choice([str(rng.randint(0, 12)), "(" + random_expression(rng, depth + 1) + ")"])
        return f"{base}**{'-' if rng.random() < 0.3 else ''}{rng.randint(0, 4)}"
    op = rng.choice(["+", "-", "*", "/", "//", "%", " + ", " * ", " - "])
    return random_expression(rng, depth + 1) + op + random_expression(rng, depth + 1)

def reference(text):
    """Python's own value for text, every number a Fraction (the test's trusted text, not the model's)."""
    as_fractions = re.sub(r"(\d+\.?\d*|\.\d+)", r"F('\1')", text)
    try:
        return exact(eval(as_fractions, {"F": Fraction}))
    except ZeroDivisionError:
        return "error: division by zero"

def refuse(*args, **kwargs):
    raise AssertionError("eval, exec or compile was called")

def calc(text):
    """calculator(text) with eval, exec and compile refused meanwhile: it must compute without them."""
    saved = builtins.eval, builtins.exec, builtins.compile
    builtins.eval = builtins.exec = builtins.compile = refuse
    try:
        return calculator(text)
    finally:
        builtins.eval, builtins.exec, builtins.compile = saved

def test_three_digit_products():
    rng = random.Random(0)
    for _ in range(3000):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        sign = rng.choice(["*", " * ", "x", " x ", "×", " × "])
        assert calc(f"{a}{sign}{b}") == str(a * b)

def test_random_expressions_against_fractions():
    rng = random.Random(1)
    texts = [t for t in (random_expression(rng) for _ in range(3000)) if len(t) <= 200]
    expected = [reference(t) for t in texts]
    for text, value in zip(texts, expected):
        assert calc(text) == value, text
    assert len(texts) > 2900 and sum(v.startswith("error") for v in expected) > 50
    assert sum("/" in v for v in expected) > 100 and sum("." in v for v in expected) > 100

@pytest.mark.parametrize("text, value", [
    ("123*456", "56088"), ("1/8", "0.125"), ("1/3", "1/3"), ("-7/3", "-7/3"), ("-1/8", "-0.125"), ("2**-3", "0.125"),
    ("-2**2", "-4"), ("(-2)**2", "4"), ("2**3**2", "512"), ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"),
    ("10 - 2 - 3", "5"), ("100 / 10 / 5", "2"), ("7 // 2", "3"), ("-7 // 2", "-4"), ("-7 % 3", "2"), ("7.5 % 2", "1.5"),
    ("3.5 x 2", "7"), ("7 ÷ 2", "3.5"), ("0.1 + 0.2", "0.3"), (".5 + 1.", "1.5"), ("--3", "3"), ("+-+3", "-3"),
    ("  12  ", "12"), ("1/1024", "0.0009765625"), ("2**100", str(2 ** 100)), ("1/3 + 1/6", "0.5"), ("0**0", "1"),
    ("(1/3) ** -2", "9"), ("(10**100)**9 / (10**100)**8", "1" + "0" * 100),
])
def test_values(text, value):
    """An integer as one, a finite decimal expansion as a decimal, any other value as a reduced fraction."""
    assert calc(text) == value

@pytest.mark.parametrize("text, error", [
    ("1/0", "division by zero"), ("5 % (2 - 2)", "division by zero"), ("5 // 0.0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2**100000", "the exponent of ** must be an integer from -100 to 100, not 100000"),
    ("2 ** -101", "the exponent of ** must be an integer from -100 to 100, not -101"),
    ("2 ** 0.5", "the exponent of ** must be an integer from -100 to 100, not 0.5"),
    ("2 ** (1/3)", "the exponent of ** must be an integer from -100 to 100, not 1/3"),
    ("9**100**2", "the exponent of ** must be an integer from -100 to 100, not 10000"),
    ("(10**100)**9 * 10**100", "number too big (more than 1000 digits)"),
    ("(9**99)**100", "number too big (more than 1000 digits)"),
    ("1 / (10**100)**9 / 10**100", "number too big (more than 1000 digits)"),
    ("__import__('os')", "unexpected character '_' at position 0"),
    ("open('x')", "unexpected character 'o' at position 0"), ("().__class__", "unexpected character '.' at position 2"),
    ("lambda: 1", "unexpected character 'l' at position 0"), ("a + 1", "unexpected character 'a' at position 0"),
    ("1 + int", "unexpected character 'i' at position 4"), ("(1).real", "unexpected character '.' at position 3"),
    ("[1][0]", "unexpected character '[' at position 0"), ("1e5", "unexpected character 'e' at position 1"),
    ("2 ^ 3", "unexpected character '^' at position 2"), ("3 x", "unexpected end of expression"),
    ("\u0663 + 1", "unexpected character '\u0663' at position 0"),
    ("1 2", "unexpected '2' after a complete expression"), ("(1 + 2", "missing ')'"), ("1 +", "unexpected end of "
                                                                                           "expression"),
    ("* 3", "unexpected '*'"), ("()", "unexpected ')'"), ("(" * 51 + "1" + ")" * 51, "more than 50 nested parentheses"),
    ("", "the expression must be a non-empty string of at most 200 characters"),
    (" \n", "the expression must be a non-empty string of at most 200 characters"),
    ("1+" * 100 + "1", "the expression must be a non-empty string of at most 200 characters"),
    (12, "the expression must be a non-empty string of at most 200 characters"),
])
def test_errors(text, error):
    assert calc(text) == "error: " + error

def test_no_text_runs(tmp_path):
    """Text that would do something in Python is refused before anything runs, and quickly: the bounds are checked
    before a power is computed."""
    marker = tmp_path / "ran"
    for text in [f"__import__('os').system('touch {marker}')", f"open('{marker}', 'w')", "9" * 190 + "**100",
                 "(" * 50 + "9**99" + ")" * 50 + "**99", "99**99**99", "((9**99)**10)**10"]:
        start = time.perf_counter()
        assert calc(text).startswith("error: ")
        assert time.perf_counter() - start < 0.1, text
    assert not marker.exists()
    assert calc("-" * 199 + "1") == "-1"

# -----------------------------------------------------------------------------
# python sandbox

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")


def sandbox_processes():
    """The processes, not ended, of a sandbox: bwrap's, and the program's and its children's (`python -I -S
    main.py`); an ended one, whether reaped or not, has an empty command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # ended meanwhile
            continue
        if b"-I\0-S\0main.py" in cmdline or b"/tmp/main.py" in cmdline:
            found.append(int(pid))
    return found

def assert_nothing_left():
    """Nothing of a sandbox is left running once python() returns (the kernel may take a moment to end it all)."""
    deadline = time.time() + 2
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []

def test_prints():
    assert python("print(6 * 7)") == "42\n"
    assert python("import sys\nprint('out')\nprint('err', file=sys.stderr)") == "out\nerr\n"
    assert python("print('é×', end='')") == "é×"
    assert python("import sys\nsys.stdout.buffer.write(b'\\xff ok')") == "\ufffd ok"
    assert python("") == ""
    assert python("print('a' * 5000)", max_output=100) == "a" * 100 + "\n[... output cut]\n"

def test_isolated_interpreter_and_directory():
    """python -I -S, stdin empty, a fresh directory it may write in (the sandbox's /tmp, which the next call does not
    see); files stop at 1 MB."""
    out = python("import os, sys\nprint(sys.flags.isolated, sys.flags.no_site, repr(sys.stdin.read()))\n"
                 "open('a.txt', 'w').write('kept')\nprint(open('a.txt').read(), sorted(os.listdir('.')), os.getcwd())")
    assert out == "1 1 ''\nkept ['a.txt', 'main.py'] /tmp\n"
    assert python("import os\nprint(sorted(os.listdir('.')))") == "['main.py']\n"
    assert python("open('big', 'wb').write(bytes(2 * 2**20))").endswith("OSError: [Errno 27] File too large")

def test_crash_shows_the_end_of_the_traceback():
    out = python("def f():\n    return 1 / 0\nprint('before')\nf()")
    assert out.startswith("before\nTraceback (most recent call last):\n") and \
        out.endswith("\nZeroDivisionError: division by zero")
    assert "error: " not in out  # not a limit: the traceback says it all
    out = python("def f(n):\n    return f(n + 1)\nf(0)", max_output=400)
    assert out.startswith("[...]\n") and out.endswith("RecursionError: maximum recursion depth exceeded")
    assert len(out) < 400
    assert python("x = (").endswith("SyntaxError: '(' was never closed")

@pytest.mark.parametrize("code", ["while True: pass", "import time; time.sleep(100)"])
def test_timeout(code):
    start = time.perf_counter()
    assert python(code, timeout=1) == "error: timed out after 1 s"
    assert time.perf_counter() - start < 1 + 2

def test_timeout_keeps_the_output_so_far():
    assert python("print('started', flush=True)\nwhile True: pass", timeout=1.5) == \
        "started\nerror: timed out after 1.5 s"

def test_output_flood_is_cut_and_the_run_ends():
    start = time.perf_counter()
    out = python("while True: print('x' * 10**6)")
    assert time.perf_counter() - start < 5
    assert out.startswith("x" * 1000) and "\n[... output cut]\n" in out and len(out) < 2100
    assert out.endswith(f"error: printed more than {MAX_OUTPUT_MB} MB")
    assert python("print(1)") == "1\n"

@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = []\nwhile True: x.append(bytearray(10**7))"])
def test_memory_limit(code):
    out = python(code)
    assert out.endswith("MemoryError\nerror: out of memory (the limit is 256 MB)")

def test_fork_bomb_is_contained_and_nothing_is_left():
    assert sandbox_processes() == []
    start = time.perf_counter()
    out = python("import os\nwhile True: os.fork()", timeout=3)
    assert time.perf_counter() - start < 3 + 2
    assert out.endswith("BlockingIOError: [Errno 11] Resource temporarily unavailable") or \
        out.endswith("error: timed out after 3 s")
    assert_nothing_left()
    assert python("print('next')") == "next\n"  # no process of the bomb holds a place under RLIMIT_NPROC

@pytest.mark.parametrize("code, timeout", [
    ("import os, time\nif os.fork() == 0:\n    time.sleep(100)\nprint('parent ends')", 5),
    ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('parent ends')", 5),
    ("import os, time\nos.fork()\nprint('both wait', flush=True)\ntime.sleep(100)", 1),
])
def test_children_do_not_outlive_the_program(code, timeout):
    """Killed with the program, when it ends or times out, even when they leave its session (the PID namespace)."""
    out = python(code, timeout=timeout)
    assert out.startswith("parent ends") or out == "both wait\nboth wait\nerror: timed out after 1 s"
    assert_nothing_left()

def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("NANOGRPO_SECRET_TOKEN", "hunter2")
    assert python("import os\nprint(sorted(os.environ), os.environ['PWD'])") == "['LANG', 'PATH', 'PWD'] /tmp\n"
    assert "hunter2" not in python("import os\nprint(os.environ, open('/proc/self/environ').read())")

def test_runs_as_nobody_and_cannot_write_outside():
    assert python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())") == "65534 65534 []\n"
    outside = tempfile.mkdtemp()  # the host's: the sandbox has a /tmp of its own
    try:
        os.chmod(outside, 0o777)
        target = os.path.join(outside, "written")
        out = python(f"open({target!r}, 'w').write('x')")
        assert out.endswith(f"FileNotFoundError: [Errno 2] No such file or directory: {target!r}")
        assert not os.path.exists(target)
    finally:
        shutil.rmtree(outside)
    for target in ["/usr/written", interpreter() + "-written", "/written"]:  # its Python's own directory too
        assert re.search(r"(Read-only file system|Permission denied): ", python(f"open({target!r}, 'w')")), target

def test_no_network():
    code = ("import socket\ntry:\n    socket.create_connection(({host!r}, {port}), timeout=2)\n    print('connected')\n"
            "except OSError as e:\n    print('no network:', e)")
    for host, port in [("1.1.1.1", 53), ("127.0.0.1", 22)]:
        assert python(code.format(host=host, port=port)).startswith("no network: ")
    assert python("import socket\nsocket.socket()").endswith("OSError: [Errno 97] Address family not supported by "
                                                           "protocol")  # no network socket at all
    # a PID namespace whose pid 1 is the program
    assert python("import os\nprint(os.getpid(), os.getppid())") == "1 0\n"

# -----------------------------------------------------------------------------
# tool calls

def call_text(body, before="I will compute it.\n"):
    return f"{before}<tool_call>\n{body}\n</tool_call>"

def boom(what):
    raise RuntimeError(f"{what} on fire")

BOOM = {"boom": (boom, {"type": "function", "function": {"name": "boom", "description": "Fails.", "parameters": {
    "type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]}}})}

def test_parse_tool_call():
    text = call_text('{"name": "calculator", "arguments": {"expression": "2+2"}}')
    assert parse_tool_call(text) == parse_tool_call(text + "\n ") == ("calculator", {"expression": "2+2"})
    two = text + "\n" + call_text('{"name": "python", "arguments": {"code": "print(1)"}}', before="")
    assert parse_tool_call(two) == ("python", {"code": "print(1)"})  # the last block
    with pytest.raises(ValueError, match="no tool call: the text must end with <tool_call>"):
        parse_tool_call(text + " and more")

def test_call_tool():
    assert call_tool(call_text('{"name": "calculator", "arguments": {"expression": "123 * 456"}}'), TOOLS) == "56088"
    assert call_tool(call_text('{"name": "python", "arguments": {"code": "print(6 * 7)"}}'), TOOLS) == "42\n"
    assert call_tool(call_text('{"name": "boom", "arguments": {"what": "disk"}}'), BOOM) == \
        "error: boom failed: RuntimeError: disk on fire"

@pytest.mark.parametrize("text, error", [
    (call_text('{"name": "calculator", "arguments": {"expression": "2+2"}'),
     "the tool call is not valid JSON: Expecting ',' delimiter: line 3 column 1 (char 59)"),
    (call_text("calculator(2+2)"), "the tool call is not valid JSON: Expecting value: line 2 column 1 (char 1)"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n',
     "no tool call: the text must end with <tool_call>{...}</tool_call>"),
    ("The answer is 4.</tool_call>", "no tool call: the text must end with <tool_call>{...}</tool_call>"),
    (call_text('["calculator", "2+2"]'), 'the tool call must be a JSON object {"name": "<tool name>", "arguments": '
                                         '{...}}'),
    (call_text('{"name": "calculator", "arguments": "2+2"}'), 'the tool call must be a JSON object {"name": "<tool '
                                                               'name>", "arguments": {...}}'),
    (call_text('{"name": "calculator"}'), 'the tool call must be a JSON object {"name": "<tool name>", "arguments": '
                                          '{...}}'),
    (call_text('{"name": "search", "arguments": {"query": "2+2"}}'), "unknown tool 'search'; the tools are: "
                                                                      "calculator, python"),
    (call_text('{"name": "calculator", "arguments": {}}'), "calculator needs the argument 'expression'"),
    (call_text('{"name": "calculator", "arguments": {"expression": "1", "precision": 3}}'),
     "calculator has no argument 'precision'; its arguments are: expression"),
    (call_text('{"name": "calculator", "arguments": {"expression": 4}}'),
     "calculator's argument 'expression' must be a JSON string, not int"),
    (call_text('{"name": "python", "arguments": {"code": 4}}'), "python's argument 'code' must be a JSON string, not int"),
    (call_text('{"name": "calculator", "arguments": {"expression": true}}'),
     "calculator's argument 'expression' must be a JSON string, not bool"),
    (call_text("[" * 5000), "the tool call's JSON is nested too deeply"),
    (call_text(" " * 20001), "the tool call is longer than 20000 characters"),
])
def test_call_tool_errors(text, error):
    assert call_tool(text, TOOLS) == "error: " + error

def test_tool_descriptions():
    for name, (function, description) in TOOLS.items():
        parameters = description["function"]["parameters"]
        assert description["type"] == "function" and description["function"]["name"] == name
        assert isinstance(description["function"]["description"], str)
        assert parameters["type"] == "object" and parameters["required"] == list(parameters["properties"])
        assert json.loads(json.dumps(description)) == description
    assert list(TOOLS["calculator"][1]["function"]["parameters"]["properties"]) == ["expression"]
    assert list(TOOLS["python"][1]["function"]["parameters"]["properties"]) == ["code"]

# -----------------------------------------------------------------------------
# rendering: Qwen2.5-Instruct's own template with tools (apply_chat_template), and the tool turns
# a multi-turn rollout appends (tool_turn)

Q25 = load_template(os.path.join(FIXTURE, "qwen2.5_template.jinja"))
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def render(messages, tools):
    return apply_chat_template(Q25, messages, tools=tools, add_generation_prompt=True)


def appended(messages, results, tools, end="<|im_end|>"):
    """The text tool_turn appends after the assistant's turn ending messages, for these results."""
    results_ = [{"role": "tool", "content": r} for r in results]
    pieces = tool_turn(Q25, messages[:-1], results_, end=end, tools=tools)
    assert [t for t, own in pieces if not own] == results  # the results are the ordinary pieces
    return "".join(t for t, _ in pieces)


@pytest.mark.parametrize("case", REF, ids=[c["name"] for c in REF])
def test_reference(case):
    """apply_chat_template reproduces the template's text; and every assistant turn ending in tool
    calls, followed by what tool_turn appends for their results, continues its prefix into the
    whole conversation."""
    messages, tools = case["messages"], case["tools"]
    assert render(messages, tools) == case["text"]
    for i, (m, calls) in enumerate(zip(messages, case["tool_calls"])):
        if calls:
            assert parse_tool_call(m["content"]) == tuple(calls[-1])
            results = []
            while i + 1 + len(results) < len(messages) and \
                    messages[i + 1 + len(results)]["role"] == "tool":
                results.append(messages[i + 1 + len(results)]["content"])
            prefix = render(messages[:i], tools) + m["content"] + "<|im_end|>"
            assert case["text"].startswith(prefix + appended(messages[:i + 1], results, tools))

CALC = {"type": "function", "function": {"name": "calculator", "description": "Exact arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CALC_LINE = ('{"type": "function", "function": {"name": "calculator", "description": "Exact arithmetic.", '
             '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": '
             '["expression"]}}}')
TOOLS_SECTION = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                 "provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + CALC_LINE +
                 "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\n</tool_call><|im_end|>\n")
USER = {"role": "user", "content": "What is 123 * 456?"}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>'
TURN = ("\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")

def test_system_tools_and_user():
    assert render([{"role": "system", "content": "Be exact."}, USER], [CALC]) == \
        render(prompt_messages([USER], "Be exact."), [CALC]) == (
        "<|im_start|>system\nBe exact." + TOOLS_SECTION +
        "<|im_start|>user\nWhat is 123 * 456?<|im_end|>\n<|im_start|>assistant\n")
    # without a system message, Qwen2.5's own
    assert render(prompt_messages("What is 123 * 456?"), [CALC]) == (
        "<|im_start|>system\n" + QWEN25_SYSTEM + TOOLS_SECTION +
        "<|im_start|>user\nWhat is 123 * 456?<|im_end|>\n<|im_start|>assistant\n")

def test_tool_call_and_result():
    messages = [USER, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "56088"}]
    text = ("<|im_start|>system\n" + QWEN25_SYSTEM + TOOLS_SECTION +
            "<|im_start|>user\nWhat is 123 * 456?<|im_end|>\n<|im_start|>assistant\n" + CALL + "<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert render(messages, [CALC]) == text
    assert appended(messages[:2], ["56088"], [CALC]) == TURN
    # a turn that ended without the end of turn token (a stop string): the template closes it first
    assert appended(messages[:2], ["56088"], [CALC], end="") == "<|im_end|>" + TURN
    assert render([USER], [CALC]) + CALL + "<|im_end|>" + TURN == text

def test_two_tool_results_in_one_user_turn():
    two_calls = CALL + "\n" + CALL.replace("123 * 456", "1/3")
    messages = [USER, {"role": "assistant", "content": two_calls}, {"role": "tool", "content": "56088"},
                {"role": "tool", "content": "1/3"}]
    turn = ("\n<|im_start|>user\n<tool_response>\n56088\n</tool_response>\n<tool_response>\n1/3\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert appended(messages[:2], ["56088", "1/3"], [CALC]) == turn
    assert render(messages, [CALC]) == render([USER], [CALC]) + two_calls + "<|im_end|>" + turn

def test_prefix_property_on_random_conversations():
    """What a multi-turn rollout relies on: the prompt, then each assistant turn (its raw text and
    <|im_end|>) and what tool_turn appends for its results, is the rendering of the whole
    conversation, at every step."""
    rng, tools = random.Random(2), [CALC, TOOLS["python"][1]]
    for _ in range(200):
        system = [{"role": "system", "content": "S"}] if rng.random() < 0.5 else []
        messages = system + [{"role": "user", "content": rng.choice(["Hi", "2+2?", " x \n"])}]
        text = render(messages, tools)
        for _ in range(rng.randint(1, 4)):
            calls = rng.randint(1, 3)
            assistant = rng.choice(["", "Let me see.\n"]) + "\n".join([CALL] * calls)
            results = [rng.choice(["56088", "error: division by zero", "a\nb\n", "", "<|im_end|>"])
                       for _ in range(calls)]
            messages += [{"role": "assistant", "content": assistant}]
            text += assistant + "<|im_end|>" + appended(messages, results, tools)
            messages += [{"role": "tool", "content": r} for r in results]
            assert render(messages, tools) == text

def test_without_tools_nothing_changes():
    turns = [USER, {"role": "assistant", "content": "56088"}, {"role": "user", "content": "Thanks"}]
    assert apply_chat_template(Q25, turns, tools=None) == apply_chat_template(Q25, turns)
    assert "# Tools" not in apply_chat_template(Q25, turns)

GEMMA3 = os.path.join(ROOT, "tests", "fixtures", "chat_templates", "gemma3.jinja")

@pytest.mark.parametrize("call, message", [
    (lambda: prompt_messages([USER, {"role": "assistant", "content": CALL}]),
     "the last prompt message is the assistant's: the model answers the last message"),
    (lambda: prompt_messages([{"role": "tool", "content": 1}]),
     "prompt message 0 is not a dict with a string 'role' and 'content'"),
    (lambda: prompt_messages([]), "a prompt is a string or a non-empty list of messages"),
    (lambda: tool_turn(load_template(GEMMA3), [USER], [{"role": "tool", "content": "1"}]),
     "gemma3.jinja's chat template refuses the conversation: Conversation roles must alternate "
     "user/assistant/"),
])
def test_bad_tool_chats(call, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        call()
    assert "\n" not in str(e.value)
