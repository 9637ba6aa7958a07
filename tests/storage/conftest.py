"""A real S3-compatible server (moto's server mode) on loopback for the S3 tests."""

from __future__ import annotations

import logging
import os
import socket
import sys
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



sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _emulators import run_azurite, run_gcs_server  # noqa: E402


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Azurite's blob service on loopback, in memory, telemetry off; one container."""
    with run_azurite(tmp_path_factory.mktemp("azurite")) as srv:
        yield srv


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """fake-gcs-server on loopback, in memory; ``writes`` says whether it serves obstore's
    object PUT (see _emulators.run_gcs_server)."""
    with run_gcs_server(tmp_path_factory.mktemp("fake-gcs")) as srv:
        yield srv
