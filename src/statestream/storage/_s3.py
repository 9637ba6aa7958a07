"""S3-compatible object storage (via ``obstore``): commit by writing a marker last.

The commit protocol, leases and leftovers are shared with the other object
stores (``_object.py``); this module says how to reach S3. Credentials come
from the usual ``AWS_*`` environment variables (read by the client) or
:class:`S3Options`; they are never put in messages or reprs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from statestream.storage._object import (
    ObjectStorage,
    check_transfer_options,
    client_and_retry,
    split_object_url,
)

__all__ = ["S3Options", "S3Storage"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3Options:
    """Where and how to reach an S3-compatible store (unset: ``AWS_*`` environment).

    Attributes:
        endpoint: e.g. ``http://127.0.0.1:9000`` for MinIO or a local server.
        region: the bucket's region.
        access_key_id, secret_access_key, session_token: credentials (hidden in repr).
        allow_http: permit plain-HTTP endpoints (local test servers).
        part_bytes: multipart upload part size.
        max_concurrency: parts uploaded in parallel per object.
        timeout_s: limit on one request, from connecting to the end of the response.
        connect_timeout_s: limit on establishing a connection.
        max_retries: retries of a failed request (server errors, dropped
            connections, timeouts of read-only requests), with exponential backoff.
        retry_timeout_s: no retry starts this long after a request's first attempt.
            A request thus fails within about ``retry_timeout_s + timeout_s``.
    """

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = dataclasses.field(default=None, repr=False)
    secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)
    allow_http: bool = False
    part_bytes: int = 16 << 20
    max_concurrency: int = 8
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_retries: int = 5
    retry_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_transfer_options(self)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    return split_object_url(url, "s3")


class S3Storage(ObjectStorage):
    """Checkpoints in an S3-compatible object store (AWS S3, MinIO, ...).

    Example:
        >>> "secret" in repr(S3Storage(S3Options(secret_access_key="secret")))
        False
    """

    scheme = "s3"
    env_prefixes = ("AWS_",)
    credentials_hint = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or pass S3Options)"
    timeout_hint = "S3Options.timeout_s / retry_timeout_s"
    list_permission = ("s3:ListBucket on the bucket (a policy may limit it to the prefix "
                       "with the s3:prefix condition)")

    options: S3Options

    def __init__(self, options: S3Options | None = None) -> None:
        super().__init__(options or S3Options())

    def _new_store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        o = self.options
        kw: dict[str, Any] = {name: getattr(o, name) for name in (
            "endpoint", "region", "access_key_id", "secret_access_key", "session_token")
            if getattr(o, name)}
        client, retry = client_and_retry(o, "AWS_", o.endpoint)
        try:
            return S3Store(bucket, client_options=client,  # type: ignore[arg-type]
                           retry_config=retry, **kw)  # type: ignore[arg-type]
        except Exception as exc:
            raise self._map_error(exc, f"configuring access to s3://{bucket}") from exc
