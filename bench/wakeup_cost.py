"""What one loopback send costs the sender when its peer sleeps between sends, and in bursts (prints figures).

Why it matters for ``bench/bench_floor.py``: there every byte a gateway sends goes to a process on
the other CPU (wrk or the mock). A send that finds the peer asleep in ``epoll_wait`` wakes it (an
inter-processor interrupt, costly on a virtual machine), and a sender that then goes idle until
the next event pays its own sleep and wake-up as well; sends in a burst find the peer awake. So
"CPU per request" at partial load depends on how the gateway's work is grouped in time, not only
on how much of it there is: a design that delays work so that it bunches (a writer thread that
group-commits, say) is charged less CPU than one that does the same work at once. Real traffic
goes to a network card, not to a process on the next CPU.

The sender runs on CPU 1, the receiver (an epoll loop reading whatever arrives) on CPU 0; each
pattern sends 300-byte messages over TCP on 127.0.0.1 for ``--seconds`` and prints the sender's
CPU time per message (user + system, its sleeps included).

    .venv/bin/python bench/wakeup_cost.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import time


def receiver(server: socket.socket) -> None:
    conn, _ = server.accept()
    poller = select.epoll()
    poller.register(conn.fileno(), select.EPOLLIN)
    while True:
        poller.poll()
        if not conn.recv(65536):
            os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    two = len(os.sched_getaffinity(0)) > 1
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    pid = os.fork()
    if pid == 0:
        if two:
            os.sched_setaffinity(0, {0})
        receiver(server)
    if two:
        os.sched_setaffinity(0, {1})
    else:
        print("! one CPU: sender and receiver share it")
    sender = socket.create_connection(server.getsockname())
    sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    message = b"x" * 300
    print("pattern                                          sends   sender CPU per send (us)")
    for burst, gap_s in ((1, 0.001), (10, 0.010), (64, 0.064), (1, 0.0)):
        sends = 0
        start = time.process_time()
        until = time.perf_counter() + args.seconds
        while time.perf_counter() < until:
            for _ in range(burst):
                sender.send(message)
            sends += burst
            if gap_s:
                time.sleep(gap_s)
        cpu = time.process_time() - start
        label = f"{burst} at a time, then idle {gap_s * 1000:.0f} ms" if gap_s else "back to back, never idle"
        print(f"{label:<44} {sends:>9,}   {cpu / sends * 1e6:8.1f}")
    sender.close()
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
