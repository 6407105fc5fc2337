"""A program that takes all the host memory the python tool lets it (tests/test_sandbox.py measures it): as many
processes as it may, each full to its address-space limit and holding every descriptor it may as a full socket or
pipe; the tmpfs full of files, then of data. Each process prints 'holding' once it has all it can get."""
import os
import socket
import time

try:
    for _ in range(64):
        if os.fork() == 0:
            break
except OSError:  # RLIMIT_NPROC
    pass
n = 0
try:
    while True:
        open(f'/tmp/f{os.getpid()}-{n}', 'w').close()
        n += 1
except OSError:  # out of files
    pass
try:
    with open(f'/dev/shm/data{os.getpid()}', 'wb') as f:
        while True:
            f.write(bytes(65536))
except OSError:  # out of space, or over the file size limit
    pass
held = []
for size in (192, 16, 1):
    try:
        while True:
            held.append(bytearray(size * 2 ** 20))
    except MemoryError:
        pass
try:
    while True:
        a, b = socket.socketpair()
        a.setblocking(False)
        held += [a, b]
        try:
            while True:
                a.send(bytes(65536))
        except BlockingIOError:
            pass
        r, w = os.pipe()
        os.set_blocking(w, False)
        held += [r, w]
        try:
            while True:
                os.write(w, bytes(65536))
        except BlockingIOError:
            pass
except (OSError, MemoryError):  # out of descriptors
    pass
print('holding', flush=True)
time.sleep(100)
