"""An HTTP proxy in front of a real server that injects faults, for the S3 tests.

It forwards every request to the upstream server (moto on 127.0.0.1) and returns its
answer, except while a fault is set: ``slowdown`` answers ``503 SlowDown`` (S3's
throttling reply) to the next N requests, ``stall`` holds every request without an
answer until cleared, ``ignore_range`` answers every read with the whole object. It
counts the requests it saw, and the bytes of the answers' bodies it sent back.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.requests = 0
        self.bytes_out = 0  # bytes of answer bodies sent to the client
        self.slowdowns_left = 0
        self.stalled = threading.Event()  # set: hold requests
        self.stall_if: Callable[[str, str], bool] | None = None  # (method, path): hold this one
        self.delay = 0.0  # seconds added before every answer
        self.strip_condition = False  # 412 answers without their <Condition> element
        self.ignore_range = False  # forward GETs without their Range (a server ignoring it)
        self.ranges_ignored = 0  # GETs whose Range was dropped
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    proxy.requests += 1
                    slow = proxy.slowdowns_left > 0
                    if slow:
                        proxy.slowdowns_left -= 1
                held = proxy.stall_if is not None and proxy.stall_if(self.command, self.path)
                while (proxy.stalled.is_set() or held) and not proxy._closing:
                    time.sleep(0.05)
                    held = proxy.stall_if is not None and proxy.stall_if(self.command, self.path)
                if proxy.delay:
                    time.sleep(proxy.delay)
                if slow:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(_SLOWDOWN)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    dropped = {"connection"}
                    if proxy.ignore_range and self.command == "GET" and "Range" in self.headers:
                        dropped.add("range")
                        with proxy._lock:
                            proxy.ranges_ignored += 1
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    if "range" in dropped and resp.status == 200:
                        self._stream(resp)  # (the whole object, never held in memory)
                        return
                    data = resp.read()
                finally:
                    conn.close()
                if resp.status == 412 and proxy.strip_condition:
                    data = re.sub(rb"<Condition>.*?</Condition>", b"", data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # (a HEAD's answer has no body but says the object's length)
                told = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", told or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                    with proxy._lock:
                        proxy.bytes_out += len(data)

            def _stream(self, resp: http.client.HTTPResponse) -> None:
                """Send ``resp`` on in 64 KiB chunks until its end or the client leaves."""
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.end_headers()
                try:
                    while chunk := resp.read(64 << 10):
                        self.wfile.write(chunk)
                        with proxy._lock:
                            proxy.bytes_out += len(chunk)
                except OSError:  # the client closed the connection: it has read enough
                    self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._closing = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closing = True
        self.stalled.clear()
        self.server.shutdown()
        self.server.server_close()
