"""A real S3-compatible server (moto's server mode) on loopback for the S3 tests."""

from __future__ import annotations

import logging
import os
import pathlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, Any]]:
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("obstore")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:  # a fixed port, so a test can stop and restart the server
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing-secret"}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds)
    client.create_bucket(Bucket="statestream-test")
    try:
        yield {"endpoint": endpoint, "client": client, "server": srv, "bucket": "statestream-test",
               **creds}
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- emulators
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for_port(proc: Any, port: int, log: Any, what: str, limit_s: float = 60) -> None:
    """Wait until ``proc`` listens on ``port``; fail (never skip) if it dies or stalls."""
    import time

    deadline = time.monotonic() + limit_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log.seek(0)
                pytest.fail(f"{what} did not start on 127.0.0.1:{port}: {log.read()[-2000:]}")
            time.sleep(0.05)


def _missing_tool(message: str) -> None:
    """An emulator that is not installed: a failure in CI (make test installs it), else a skip."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


#: Azurite's documented development account (public, the same in every installation).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")


def azurite_binary() -> str | None:
    """``azurite-blob`` from ``make azurite`` (.tools/), $STATESTREAM_AZURITE or PATH."""
    import shutil

    here = pathlib.Path(__file__).resolve().parents[2] / ".tools/node_modules/.bin/azurite-blob"
    for candidate in (os.environ.get("STATESTREAM_AZURITE"), str(here)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("azurite-blob")


def azurite_create_container(endpoint: str, name: str) -> None:
    """Create a container with a SharedKey-signed PUT (obstore creates none)."""
    import base64
    import email.utils
    import hashlib
    import hmac
    import http.client
    import urllib.parse

    url = urllib.parse.urlsplit(endpoint)
    date = email.utils.formatdate(usegmt=True)
    version = "2021-08-06"
    to_sign = ("PUT" + "\n" * 12 + f"x-ms-date:{date}\nx-ms-version:{version}\n"
               f"/{AZURITE_ACCOUNT}{url.path}/{name}\nrestype:container")
    sig = base64.b64encode(hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(),
                                    hashlib.sha256).digest()).decode()
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    try:
        conn.request("PUT", f"{url.path}/{name}?restype=container", body=b"",
                     headers={"x-ms-date": date, "x-ms-version": version,
                              "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{sig}"})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status not in (201, 409):
        pytest.fail(f"Azurite refused to create container {name}: {resp.status} {body[:300]!r}")


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Azurite's blob service on loopback, in memory, telemetry off; one container."""
    import subprocess

    pytest.importorskip("obstore")
    binary = azurite_binary()
    if binary is None:
        _missing_tool("Azurite is not installed: `make azurite` (or `make test`) installs it "
                      "into .tools/")
        raise AssertionError("unreachable")
    port = _free_port()
    work = tmp_path_factory.mktemp("azurite")
    log = open(work / "azurite.log", "w+")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
         "--disableTelemetry", "--silent", "--skipApiVersionCheck", "--loose"],
        cwd=work, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(proc, port, log, "Azurite")
        endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
        azurite_create_container(endpoint, "statestream-test")
        yield {"endpoint": endpoint, "container": "statestream-test", "process": proc,
               "account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
