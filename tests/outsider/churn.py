"""An outsider churning TCP connections to a port: plain Python, raw sockets, no key.

Run by path: ``python tests/outsider/churn.py HOST PORT HOLD``. It prints
``ready`` once its first connection is made, then opens connection after
connection, each saying nothing, a few random bytes, or half a hello, and keeps the
last ``HOLD`` of them open (closing the oldest as it opens a new one: 0 closes each
at once), until its stdin closes (or 120 s pass); then it prints one JSON line
``{"connections": n, "errors": m}``.

It imports nothing of the project: what it can do, anyone who reaches the port can.
"""

import collections
import json
import os
import socket
import sys
import threading
import time


def main():
    host, port, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    held, made, errors = collections.deque(), 0, 0
    until = time.monotonic() + 120
    while not stop.is_set() and time.monotonic() < until:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            what = made % 3
            if what == 1:
                sock.send(os.urandom(16))
            elif what == 2:
                sock.send(b"WTT1\x01")  # the start of a hello, never finished
            held.append(sock)
            made += 1
            if made == 1:
                print("ready", flush=True)
        except OSError:
            errors += 1
        while len(held) > hold:
            held.popleft().close()
    for sock in held:
        sock.close()
    print(json.dumps({"connections": made, "errors": errors}), flush=True)


if __name__ == "__main__":
    main()
