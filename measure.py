"""
Measuring the machine: wall time per phase, memory, the matmul peak that MFU is a fraction of, and the progress
lines of long phases; and the one setting of the machine's C library that CPU speed needs (keep_freed).

train.py logs with these and bench.py builds its numbers on them; the model and the loss never need them.
"""
import ctypes
import functools
import os
import resource
import sys
import time

import torch


def sync(device):
    """Wait for the device's queued work (CUDA is asynchronous), so a clock read after it means something."""
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


def timed_rounds(fns, device, repeat, warmup=1):
    """Best seconds of each of fns, timed in turn, `repeat` rounds: numbers meant to be compared, e.g. as a ratio,
    then see the same slow spells of a shared machine."""
    for fn in fns * warmup:
        fn()
    best = [float('inf')] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def timed(fn, device, repeat, warmup=1):
    """Best wall-clock seconds of fn() over `repeat` runs, after `warmup` untimed ones."""
    return timed_rounds([fn], device, repeat, warmup)[0]


def lap(times, key, since, device):
    """Add the wall time since `since` to times[key] (after the device's queued work), and return now, the start
    of the next phase."""
    sync(device)
    now = time.perf_counter()
    times[key] = times.get(key, 0.0) + now - since
    return now


@functools.lru_cache(maxsize=4)  # once per process and dtype: tests run train.py many times in one process
def matmul_peak(device, dtype=torch.float32, repeat=5):
    """The machine's own matmul throughput in FLOP/s in `dtype` (a big square matmul), and what was measured. MFU
    is against this, not a datasheet: CPUs differ 2x in float32 and some have bf16 matrix units. On a CPU the size
    doubles from 256 up to 2048 while one product takes under 50 ms: bf16 without matrix units runs ~100x slower
    than float32 there, and a 2048 one would take minutes."""
    cuda = torch.device(device).type == 'cuda'
    n = 8192 if cuda else 256
    while True:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        if cuda or n >= 2048 or timed(lambda: a @ b, device, repeat=1) > 0.05:
            break
        n *= 2
    seconds = timed(lambda: a @ b, device, repeat=repeat)
    return 2 * n**3 / seconds, f"{n}x{n} {dtype}".replace('torch.', '')


def keep_freed(device):
    """On a CPU device, have the C library keep freed memory in the process for the next tensors, as PyTorch's
    caching allocator does on a GPU, instead of handing it back. glibc's malloc gives every block over 32 MB (the
    output layer's chunks of logits, its weight gradient) a mapping of its own and unmaps it when freed, so the next
    one of that size pays a page fault per 4 KB page when first written: measured, a fifth of a training step at
    bench.py's default shape. The price: the resident memory (memory_mb) stays at its high-water mark, which
    fragmentation raises (7-17% in train.py at that shape). Not for a GPU run, whose host memory would keep what
    loading a checkpoint once needed. Linux with glibc only; elsewhere nothing changes."""
    if torch.device(device).type != 'cpu' or not sys.platform.startswith('linux'):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library; musl has no mallopt
    except (OSError, AttributeError):
        return
    mallopt(-4, 0)  # M_MMAP_MAX: no block gets a mapping of its own, every one comes from the heap
    mallopt(-1, -1)  # M_TRIM_THRESHOLD: -1, the heap's free top is never handed back


def memory_mb(device):
    """CUDA: the peak allocated since the last call. CPU: the resident memory now (peak where /proc is missing)."""
    if torch.device(device).type == 'cuda':
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def hms(seconds):
    """7m05s, or 01:02:03 from an hour up: for eta and elapsed times in progress lines."""
    return time.strftime('%H:%M:%S', time.gmtime(seconds)) if seconds >= 3600 else \
        f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def ticker(what, total, unit, interval):
    """A progress line for a long phase (warm start, evaluation): tick(done) prints `what: done/total unit (elapsed,
    eta)` at most every interval seconds (math.inf: never, as on all ranks but the first), so short phases stay
    quiet."""
    t0 = last = time.time()

    def tick(done, extra=''):
        nonlocal last
        now = time.time()
        if now - last >= interval and done < total:
            eta = (now - t0) / done * (total - done)
            print(f"{what}: {done}/{total} {unit}{extra} ({hms(now - t0)}, eta {hms(eta)})", flush=True)
            last = now
    return tick
