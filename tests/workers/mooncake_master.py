"""A real ``mooncake_master`` for the tests, on 127.0.0.1 with free ports, stopped by PID.

The Mooncake client binds wildcard addresses that no option changes, so these tests run
inside a private network namespace (``unshare -n``, loopback up), where a wildcard bind
reaches nothing but loopback: :func:`require_private_network` fails the run elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from redis_server import free_port, wait_ready


def require_private_network() -> None:
    """Raise unless this process is in a network namespace with loopback only."""
    interfaces = sorted(name for _, name in socket.if_nameindex())  # this process's netns
    if interfaces != ["lo"]:
        raise RuntimeError(
            "the Mooncake tests must run in a private network namespace (the client binds "
            f"wildcard addresses); interfaces here: {interfaces}. Run them as "
            "scripts/test.sh does: unshare -n bash -c 'ip link set lo up && ...'"
        )


def binary() -> str:
    found = shutil.which("mooncake_master") or str(
        Path(sys.executable).with_name("mooncake_master")
    )
    if not Path(found).is_file():
        raise RuntimeError("no mooncake_master: pip install mooncake-transfer-engine-non-cuda")
    return found


class MooncakeMaster:
    """One master; ``address`` once started; ``stop()``/``start()`` keep the port."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.logdir = tempfile.mkdtemp(prefix="mc-master-")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        cmd = [binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
               "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
               f"--log_dir={self.logdir}", *self.args]  # fmt: skip
        log = open(os.path.join(self.logdir, "stderr.log"), "ab")  # noqa: SIM115
        self.proc = proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        log.close()

        def listening() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), 0.5):
                return True

        try:
            wait_ready(proc, listening, f"mooncake_master on port {self.port}", timeout,
                       lambda: Path(self.logdir, "stderr.log").read_text(errors="replace"))  # fmt: skip
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def running_master(*args: str) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(*args)
    master.start()
    try:
        yield master
    finally:
        master.stop()


class MooncakeHolder:
    """A storage node (``mooncake_holder.py``) lending ``size`` bytes to the master's store."""

    def __init__(self, master: MooncakeMaster, size: int = 512 << 20) -> None:
        self.master = master
        self.size = size
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        script = Path(__file__).with_name("mooncake_holder.py")
        log = open(os.path.join(self.master.logdir, "holder.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(script), self.master.address, str(self.size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
        )  # fmt: skip
        log.close()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = self.proc.stdout.readline()
        if line.strip() != b"ready" or time.monotonic() > deadline:
            self.stop()
            raise RuntimeError(f"the Mooncake holder did not start: {line!r}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


@contextlib.contextmanager
def running_store(size: int = 512 << 20) -> Iterator[tuple[MooncakeMaster, MooncakeHolder]]:
    """A master and one storage node."""
    with running_master() as master:
        holder = MooncakeHolder(master, size)
        holder.start()
        try:
            yield master, holder
        finally:
            holder.stop()
