"""How long slow clients lock everyone else out of `hipc serve` (loopback only).

Run:
    python docs/benchmarks/slow_clients.py --artifact PATH [--python PYTHON]
        [--clients 140] [--interval 5] [--window 60] [--reconnect] [-- SERVE FLAGS...]

Starts `PYTHON -m hipc.cli.main serve PATH` (PYTHON: this interpreter unless given, so
an older checkout's venv measures the code before a change), then opens --clients
connections that each send a request line and then one header line every --interval
seconds, never finishing the request (with --reconnect, a closed one is opened again at
once, as a determined attacker would). Meanwhile a well-behaved client asks GET /health
every 0.5 s with a 1 s timeout, for --window seconds.

Prints the share of /health probes that failed and the longest stretch without an
answer: the lock-out.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"


def start(python: str, artifact: str, flags: list[str]) -> tuple[subprocess.Popen, int]:
    log = Path(tempfile.mkstemp(prefix="hipc-slow-", suffix=".log")[1])
    cmd = [python, "-m", "hipc.cli.main", "serve", artifact, "--host", HOST, "--port", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*cmd, *flags], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"ready: http://[0-9.]+:([0-9]+)", log.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"hipc serve did not start:\n{log.read_text(errors='replace')}")


def health(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1) as s:
            s.settimeout(1)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--clients", type=int, default=140)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--reconnect", action="store_true")
    p.add_argument("flags", nargs="*", help="more `hipc serve` flags (after --)")
    args = p.parse_args()

    proc, port = start(args.python, args.artifact, args.flags)
    stop = threading.Event()
    opened = [0]

    def trickler() -> None:
        s = None
        while not stop.is_set():
            if s is None:
                try:
                    s = socket.create_connection((HOST, port), timeout=5)
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                    opened[0] += 1
                except OSError:
                    s = None
                    time.sleep(0.2)
                    continue
            if stop.wait(args.interval):
                break
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                s.close()
                s = None
                if not args.reconnect:
                    return
        if s is not None:
            s.close()

    threads = [threading.Thread(target=trickler, daemon=True) for _ in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(1)  # let them connect
    t0 = time.monotonic()
    probes, failed, longest, down_since = 0, 0, 0.0, None
    while time.monotonic() - t0 < args.window:
        t = time.monotonic()
        ok = health(port)
        probes += 1
        if ok:
            if down_since is not None:
                longest = max(longest, t - down_since)
            down_since = None
        else:
            failed += 1
            down_since = t if down_since is None else down_since
        time.sleep(max(0.0, 0.5 - (time.monotonic() - t)))
    if down_since is not None:
        longest = max(longest, time.monotonic() - down_since)
    stop.set()
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    print(
        f"{args.clients} trickling clients (a header line every {args.interval:g} s"
        f"{', reconnecting' if args.reconnect else ''}; {opened[0]} connections opened), "
        f"flags {' '.join(args.flags) or '(defaults)'}: /health failed {failed} of {probes} "
        f"probes over {args.window:g} s; longest lock-out {longest:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
