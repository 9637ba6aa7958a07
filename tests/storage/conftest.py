"""A real S3-compatible server (moto's server mode) on loopback for the S3 tests."""

from __future__ import annotations

import logging
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
