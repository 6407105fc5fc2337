"""
Tools for multi-turn rollouts: an exact calculator, a sandboxed Python runner, and Qwen-style tool calls turned into
the observation shown to the model. What the model writes never raises: a failure is "error: <what was wrong>".
"""
import contextlib
import ctypes
import json
import math
import operator
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from fractions import Fraction
from functools import cache

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
# python: a fresh interpreter in a subprocess, fenced in by limits, namespaces and an unprivileged uid

NOBODY = 65534  # uid and gid of 'nobody': when we are root, programs run as it
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID, PR_SET_PDEATHSIG = 0x10000000, 0x40000000, 0x20000000, 1
MAX_PROCESSES = 16  # RLIMIT_NPROC counts every process of the uid: it bounds a fork bomb, and concurrent sandboxes
MAX_FILE_MB, MAX_OPEN_FILES = 1, 64  # RLIMIT_FSIZE (output included), RLIMIT_NOFILE


def _unshare():
    """Give this process's children new network (no interface up) and PID namespaces: as root, or in a new user
    namespace where the kernel lets unprivileged users make one. False when the OS refuses."""
    flags = CLONE_NEWNET | CLONE_NEWPID | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
    try:  # libc's: os.unshare is Python >= 3.12's
        return ctypes.CDLL(None, use_errno=True).unshare(flags) == 0
    except (OSError, AttributeError):  # a libc without unshare: not Linux
        return False


def _launcher(memory_mb, cpu_seconds, argv):
    """Confine this process, then run argv as the first process of a new PID namespace (whose end kills the rest)
    where the OS allows, and end as it ended. python() starts it as `python tools.py ...`, a fresh single-threaded
    process: as its preexec_fn this could deadlock between fork and exec when the trainer has threads."""
    isolated = _unshare()  # first: it needs the privileges dropped below
    limits = {resource.RLIMIT_AS: memory_mb * 2 ** 20, resource.RLIMIT_CPU: cpu_seconds,
              resource.RLIMIT_NPROC: MAX_PROCESSES, resource.RLIMIT_FSIZE: MAX_FILE_MB * 2 ** 20,
              resource.RLIMIT_NOFILE: MAX_OPEN_FILES, resource.RLIMIT_CORE: 0}
    for kind, value in limits.items():
        hard = resource.getrlimit(kind)[1]
        resource.setrlimit(kind, (value, value) if hard == resource.RLIM_INFINITY else (min(value, hard),) * 2)
    if os.geteuid() == 0:  # an error here stops the launcher: the program never runs as root
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    if not isolated:
        os.execv(argv[0], argv)
    # python()'s timeout: kill the program (so its namespace) and reap it, not leave it to an init that may not
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    child = os.fork()
    if child == 0:  # killed with the launcher, even if it leaves the process group that python() kills
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.execv(argv[0], argv)
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if status < 0:  # killed by a signal: so are we, for python() to see
        if -status != signal.SIGKILL:
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


def _launch(argv, memory_mb=256, cpu_seconds=2, **popen):
    """Start argv (a program and its arguments) confined, in a new session, through the launcher."""
    launcher = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(memory_mb), str(cpu_seconds)]
    return subprocess.Popen(launcher + argv, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=dict(PATH="/usr/bin:/bin", LANG="C.UTF-8"), **popen)


@cache
def network_isolation():
    """Whether python()'s programs run without network and in a PID namespace (checked once: can we unshare?)."""
    probe = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--can-unshare"]
    return subprocess.run(probe, stdin=subprocess.DEVNULL, capture_output=True).returncode == 0


@cache
def interpreter():
    """The Python that programs run on: ours, unless we are root and nobody cannot run it (pyenv installs under
    /root, which only root may enter), then the first of the system's that nobody can run; None if there is none."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.geteuid() != 0 or _launch([candidate, "-I", "-S", "-c", "pass"], stderr=subprocess.DEVNULL).wait() == 0:
            return candidate


def _cut(text, limit):
    return text if len(text) <= limit else text[:limit] + "\n[... output cut]\n"


def python(code, timeout=5.0, memory_mb=256, max_output=2000):
    """What a Python program prints (stdout, then stderr), cut to max_output characters; when it fails, stdout's
    start, stderr's last lines (a traceback's end) and, for a limit, a line "error: ..." (timed out after `timeout`
    s of wall-clock time, out of memory, ...). Never raises. The sandbox: `python -I -S` in a fresh temporary
    directory, environment PATH and LANG, stdin empty; limits on memory, CPU time, processes, file size, open files
    and core dumps; new network and PID namespaces where the OS allows (network_isolation(); else a child leaving its
    session outlives it); as root, the uid of nobody, which writes only there and in world-writable places."""
    if interpreter() is None:
        return "error: no Python interpreter that the user nobody can run (we are root: programs never run as root)"
    with tempfile.TemporaryDirectory(prefix="nanogrpo-python-", ignore_cleanup_errors=True) as workdir, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        # outputs go to files, not pipes: a program printing forever meets RLIMIT_FSIZE instead of filling our
        # memory, and a child left holding them does not keep us waiting
        try:
            proc = _launch([interpreter(), "-I", "-S", "main.py"], memory_mb, math.ceil(timeout) + 1, cwd=workdir,
                           stdout=out, stderr=err)
        except OSError as e:
            return f"error: could not start python: {e}"
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()  # see _launcher
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # whatever is left of its group
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stdout = os.pread(out.fileno(), 4 * max_output, 0).decode("utf-8", errors="replace")
        start = max(0, os.fstat(err.fileno()).st_size - 4 * max_output)
        stderr = os.pread(err.fileno(), 4 * max_output, start).decode("utf-8", errors="replace")
    if proc.returncode == 0 and not timed_out:
        return _cut(stdout + stderr, max_output)
    tail = stderr[-(max_output // 2):]  # the last whole lines: a traceback's end says what went wrong
    tail = tail if len(stderr) <= max_output // 2 else "[...]\n" + tail[tail.find("\n") + 1:]
    failure = (f"error: timed out after {timeout:g} s" if timed_out else  # the limits' signals: SIGXCPU, SIGXFSZ, ...
               f"error: killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else
               f"error: out of memory (the limit is {memory_mb} MB)" if tail.rstrip().endswith("MemoryError") else "")
    return "\n".join(p.rstrip("\n") for p in (_cut(stdout, max_output - len(tail)), tail, failure) if p.strip())

# -----------------------------------------------------------------------------
# tool calls in Qwen's format: the assistant's turn ends with <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>


def parse_tool_call(text):
    """(name, arguments) of the last <tool_call> block of an assistant turn that ends with </tool_call>; raises
    ValueError saying what is wrong with it (call_tool shows that to the model)."""
    text = text.rstrip()
    start = text.rfind("<tool_call>")
    if start < 0 or not text.endswith("</tool_call>"):
        raise ValueError("no tool call: the text must end with <tool_call>{...}</tool_call>")
    try:
        call = json.loads(text[start + len("<tool_call>"):-len("</tool_call>")])
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool call is not valid JSON: {e}") from None
    if (not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["name"], str)
            or not isinstance(call["arguments"], dict)):
        raise ValueError('the tool call must be a JSON object {"name": "<tool name>", "arguments": {...}}')
    return call["name"], call["arguments"]


def call_tool(text, tools):
    """The observation for the tool call ending `text`: tools[name][0](**arguments), tools mapping a name to
    (function, description in the OpenAI/Qwen function format), or "error: ..." saying what was wrong."""
    try:
        name, arguments = parse_tool_call(text)
    except ValueError as e:
        return f"error: {e}"
    if name not in tools:
        return f"error: unknown tool {name!r}; the tools are: {', '.join(tools)}"
    function, description = tools[name]
    known = description["function"]["parameters"]["properties"]
    missing = [key for key in description["function"]["parameters"].get("required", []) if key not in arguments]
    unknown = [key for key in arguments if key not in known]
    if missing or unknown:
        return (f"error: {name} needs the argument {missing[0]!r}" if missing else
                f"error: {name} has no argument {unknown[0]!r}; its arguments are: {', '.join(known)}")
    try:
        return str(function(**arguments))
    except Exception as e:  # the observation reports any failure of the tool: the rollout goes on
        return f"error: {name} failed: {type(e).__name__}: {e}"


def _tool(function, about, parameter, parameter_about):
    """(function, its description in the OpenAI/Qwen function format) for a tool of one string parameter."""
    return function, {"type": "function", "function": {"name": function.__name__, "description": about, "parameters": {
        "type": "object", "properties": {parameter: {"type": "string", "description": parameter_about}},
        "required": [parameter]}}}


TOOLS = {  # the built-in tools, for call_tool; their descriptions go to render_chat(..., tools=...)
    "calculator": _tool(calculator, "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and "
                        "parentheses. The result is an integer, a decimal or a reduced fraction such as 1/3.",
                        "expression", "e.g. (123 * 456) / 7"),
    "python": _tool(python, "Run a Python 3 program (standard library only, no network, 5 s, 256 MB) and return what "
                    "it prints.", "code", "the program; print the results you need"),
}

if __name__ == "__main__":  # the launcher (see _launcher), or network_isolation()'s check
    if sys.argv[1:] == ["--can-unshare"]:
        sys.exit(0 if _unshare() else 1)
    _launcher(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
