"""A real S3 server for the tests: moto's, started on 127.0.0.1 with a free port, stopped by PID.

``moto_server`` (the ``moto[s3]`` package with Flask, which the test command installs)
keeps its buckets in memory: a restart is an empty server. With ``enforce_auth`` it
checks signatures against the IAM users it knows, after the first few requests (which
:meth:`MotoServer.start` spends on making one user with full rights).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from typing import Any

from redis_server import free_port, wait_ready

#: Requests moto lets through without checking credentials when auth is enforced: the
#: ones that make the user, its policy and its key.
_UNCHECKED = 4


class MotoServer:
    """One ``moto_server`` process; ``endpoint`` once started; ``stop()``/``start()`` keep the port."""

    def __init__(self, enforce_auth: bool = False) -> None:
        self.port = free_port()
        self.enforce_auth = enforce_auth
        self.proc: subprocess.Popen[bytes] | None = None
        self.key, self.secret = "testing-key", "testing-secret"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        env = {**os.environ, "MOTO_CALL_RESET_API": "false", "AWS_DEFAULT_REGION": "us-east-1"}
        if self.enforce_auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_UNCHECKED)
        cmd = [sys.executable, "-c", "from moto.server import main; main()",
               "-H", "127.0.0.1", "-p", str(self.port)]  # fmt: skip
        # moto logs every request: to a file (a pipe nobody reads would fill and stop it)
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.proc = proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                            stderr=self._log)  # fmt: skip

        def answers() -> bool:
            with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1) as r:
                return bool(r.status == 200)

        def output() -> str:
            self._log.seek(0)
            return self._log.read().decode(errors="replace")

        try:
            wait_ready(proc, answers, f"moto_server on port {self.port}", timeout, output)
        except RuntimeError:
            self.stop()
            raise
        if self.enforce_auth:
            self._make_user()

    def _make_user(self) -> None:
        """An IAM user with every right, and its key: the credentials moto will accept."""
        import json

        iam = self.client("iam")
        iam.create_user(UserName="tester")
        iam.put_user_policy(UserName="tester", PolicyName="all", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }))  # fmt: skip
        made = iam.create_access_key(UserName="tester")["AccessKey"]
        self.key, self.secret = made["AccessKeyId"], made["SecretAccessKey"]

    def client(self, service: str = "s3") -> Any:
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.key, aws_secret_access_key=self.secret)  # fmt: skip

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def running_moto(enforce_auth: bool = False) -> Iterator[MotoServer]:
    server = MotoServer(enforce_auth)
    server.start()
    try:
        yield server
    finally:
        server.stop()
