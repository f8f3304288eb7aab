"""What waking a process costs the one that writes: CPU per 200-byte send on a Unix socket pair, with the reader
asleep in recv (each send wakes it) or spinning on a non-blocking socket (no wake), the writer busy GAP seconds
between sends (as a front-end is between its writes to the engine).

    python results/issue37/wake_cost.py block|spin [GAP]      # e.g. block 0.0002
"""
import os
import socket
import sys
import time

N = 20000
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
mode = sys.argv[1]
gap = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
pid = os.fork()
if pid == 0:
    a.close()
    if mode == "spin":
        b.setblocking(False)
    got = 0
    while got < N * 200:
        try:
            got += len(b.recv(65536))
        except BlockingIOError:
            continue
    os._exit(0)
b.close()
msg = b"x" * 200
t0, w0 = time.process_time(), time.perf_counter()
for _ in range(N):
    a.send(msg)
    end = time.perf_counter() + gap
    while time.perf_counter() < end:
        pass
t1, w1 = time.process_time(), time.perf_counter()
os.waitpid(pid, 0)
print(f"{mode} gap={gap * 1e6:.0f}us: writer CPU per send {(t1 - t0) / N * 1e6 - gap * 1e6:.1f} us "
      f"(wall {(w1 - w0) / N * 1e6:.1f})")
