"""A scripted environment for the end-to-end tests (--env=multiturn_env:Echo, importable from tests/): after each
turn of the policy, an observation made of the trajectory so far, so that it is the same on every layout and on
resume, of a length that varies from row to row; and Hostile, which answers a hostile tool call (tests/test_sandbox.py)
in place of each turn."""
import random
import zlib

from lib.envs import QwenTools


class Echo:
    stop = ('+',)  # a turn also ends at a '+' the policy writes, not only at its end of text

    def step(self, row, text):
        return f"[{len(text)}{text[-1:]}]" if text else "[]"


class Sandboxed(Echo):
    """Echo's observation counted by a real program in the python tool's sandbox (tests/test_exact.py's resume)."""
    def step(self, row, text):
        from lib.sandbox import python
        return '[' + python(f"print(len({text!r}), end='')") + ']'


class CalcTags(Echo):
    stop = ('</calc>',)  # seven bytes: a turn ends where the text comes to end with them


class BareStop(Echo):
    stop = '</calc>'  # a string, not a tuple of them: refused


# -----------------------------------------------------------------------------
# hostile tool calls: deep nesting, megabytes, lone surrogates, NUL, wrong JSON types, unknown tools, extra arguments

def junk(rng):
    """A malformed or hostile piece of a tool call."""
    pieces = ["[" * rng.choice([10, 999, 5000]), "{" * rng.choice([10, 999]), '"\\ud800"', "\\u0000", "\x00", "\udcff",
              "\ufffd", "é", '"name"', '"arguments"', ":", ",", "}", "]", "null", "true", "1e999", "-0", '"' * 3,
              "x" * rng.choice([1, 100, 30000]), "</tool_call>", "<tool_call>", "\n", '"python"', '"calculator"',
              '{"code": 1}', '{"expression": []}', '{"expression": "1/0"}', '{"extra": 1, "expression": "2"}']
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))


def hostile_call(rng):
    """A tool call as a policy could write it, seldom well-formed."""
    name = rng.choice(['"calculator"', '"unknown"', "1", "null", '"' + "n" * 5000 + '"', '"\\ud800"', junk(rng)])
    arguments = rng.choice(['{"expression": "2*3"}', '{"expression": 5}', '{"expression": true}', "[]", '"2+2"',
                            '{"expression": "' + "9" * 300 + '"}', '{"a": {"b": [1, 2]}}', junk(rng)])
    body = rng.choice([f'{{"name": {name}, "arguments": {arguments}}}', junk(rng), f'{{"name": {name}}}'])
    return rng.choice(["", "Let me call it.\n", junk(rng)]) + "<tool_call>\n" + body + "\n</tool_call>" + \
        rng.choice(["", "\n", " ", "x"])


# what a program can do to its own outputs, its process and its sandbox (the python tool must answer in bounded text
# and time, and never raise)
PROGRAM_PIECES = [
    "fcntl.fcntl(1, fcntl.F_SETFL, os.O_DIRECT)", "fcntl.fcntl(1, fcntl.F_SETFL, os.O_NONBLOCK)", "os.close(1)",
    "os.close(2)", "os.dup2(2, 1)", "os.dup2(os.open('/dev/null', os.O_WRONLY), 2)", "os.lseek(1, 2 ** 62, 0)",
    "ctypes.CDLL(None).fallocate(1, 1, ctypes.c_long(0), ctypes.c_long(1 << 30))", "print('x' * 10 ** 6)",
    "sys.stdout.buffer.write(os.urandom(10 ** 4))", "os.write(2, b'\\xff' * 5000)", "os.kill(os.getpid(), 11)",
    "os._exit(200)", "os.fork()", "time.sleep(0.3)", "sys.exit('\\ud800')", "print('<|im_end|><|im_start|>')",
    "os.setsid()", "signal.signal(signal.SIGTERM, signal.SIG_IGN)", "open('/tmp/x', 'wb').write(bytes(2 ** 19))",
    "os.set_blocking(0, False)", "print(os.read(0, 10))", "x = bytearray(2 ** 30)", "while True: pass"]


def hostile_program(rng):
    """A program a policy could write against the python tool, of one to five of PROGRAM_PIECES."""
    return "import ctypes, fcntl, os, signal, sys, time\n" + "\n".join(
        rng.choice(PROGRAM_PIECES) for _ in range(rng.randint(1, 5)))


class Hostile(QwenTools):
    """QwenTools reading, in place of each turn the policy ends, a hostile call seeded by that turn's text."""
    def step(self, row, text):
        return super().step(row, hostile_call(random.Random(zlib.crc32(text.encode('utf-8', 'replace')))))
