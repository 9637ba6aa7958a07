"""Object stores: URLs, transfer options, client options, secrets kept out of messages."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
from typing import Any

from statestream.errors import StorageError

__all__ = ["DAMAGED_MARKER", "DELETING_NAME", "ROOT_RE", "TransferOptions",
           "check_transfer_options", "client_and_retry", "env_client_options", "redact",
           "split_object_url", "version_of"]

ROOT_RE = re.compile(r"^[0-9a-f]{32}$")

#: What ObjectStorage._live_root answers for a commit marker that is there but names
#: no valid root (not a root name: those are 32 hex digits).
DAMAGED_MARKER = "damaged"

#: The object a deletion writes beside the commit marker before it removes anything and
#: deletes last: what a deletion killed part-way left is known by it (a save in flight
#: to the same path has unreferenced roots too, and is not to be taken for remains).
DELETING_NAME = "DELETING"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferOptions:
    """How objects move: part size, concurrency, timeouts, retries (GCS and Azure options)."""

    allow_http: bool = False
    part_bytes: int = 16 << 20
    max_concurrency: int = 8
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_retries: int = 5
    retry_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_transfer_options(self)


def check_transfer_options(options: Any) -> None:
    """Refuse timeouts that are not positive, negative retry counts, and part sizes
    or concurrencies below one."""
    cls = type(options).__name__
    for name in ("timeout_s", "connect_timeout_s", "retry_timeout_s"):
        if not getattr(options, name) > 0:
            raise StorageError(f"{cls}.{name} must be > 0, got {getattr(options, name)!r}")
    if options.max_retries < 0:
        raise StorageError(f"{cls}.max_retries must be >= 0, got {options.max_retries}")
    for name in ("part_bytes", "max_concurrency"):
        if type(getattr(options, name)) is not int or getattr(options, name) < 1:
            raise StorageError(f"{cls}.{name} must be a positive int, got "
                               f"{getattr(options, name)!r}")


def split_object_url(url: str, scheme: str, word: str = "bucket") -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``); ``word`` names the bucket in messages.

    Trailing ``/`` are ignored; an empty segment elsewhere (``s3://b//a``,
    ``s3://b/a//c``), ``.`` and ``..`` are refused (a StorageError).
    """
    head = f"{scheme}://"
    if not url.startswith(head):
        raise StorageError(f"not an {head} URL: {url!r}")
    rest = url[len(head):]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.rstrip("/")  # a leading "/" is an empty segment
    if len(bucket) < 3 or not prefix:
        raise StorageError(
            f"{url!r} must look like {head}{word}/prefix ({word} names have 3+ characters)"
        )
    if any(part in ("", ".", "..") for part in prefix.split("/")):
        raise StorageError(f"{url!r} has an empty, '.' or '..' path segment")
    return bucket, prefix


#: Query parameters that carry secrets (an Azure SAS ``sig``, signed-URL signatures, tokens).
_SECRET_QUERY = re.compile(r"(?i)([?&][\w.-]*(?:sig|signature|token|credential|key)[\w.-]*=)"
                           r"[^&\s\"']*")


def redact(text: str) -> str:
    """``text`` with secret-looking words and query parameters replaced by ``<hidden>``."""
    text = _SECRET_QUERY.sub(r"\1<hidden>", text)
    return re.sub(r"(?i)(secret|signature|credential|token)[^ ,;]*", r"\1=<hidden>", text)


#: Client options obstore reads from ``<PREFIX><NAME>`` only when given none explicitly.
_ENV_CLIENT_BOOLS = ("allow_http", "allow_invalid_certificates", "http1_only", "http2_only")
_ENV_CLIENT_STRINGS = ("proxy_url", "proxy_ca_certificate", "proxy_excludes", "user_agent")


def env_client_options(prefix: str) -> dict[str, Any]:
    """``AWS_ALLOW_HTTP`` & co.: passing client options (for the timeouts) makes obstore
    ignore these variables, so they are read here."""
    out: dict[str, Any] = {}
    for name in _ENV_CLIENT_BOOLS:
        value = os.environ.get(f"{prefix}{name.upper()}")
        if value is not None:
            out[name] = value.strip().lower() == "true"
    for name in _ENV_CLIENT_STRINGS:
        value = os.environ.get(f"{prefix}{name.upper()}")
        if value:
            out[name] = value
    return out


def client_and_retry(options: Any, env_prefix: str, endpoint: str | None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """obstore's ``client_options`` and ``retry_config`` from transfer options."""
    client = env_client_options(env_prefix)
    client["timeout"] = datetime.timedelta(seconds=options.timeout_s)
    client["connect_timeout"] = datetime.timedelta(seconds=options.connect_timeout_s)
    if options.allow_http or (endpoint or "").startswith("http://"):
        client["allow_http"] = True
    retry: dict[str, Any] = {
        "max_retries": options.max_retries,
        "retry_timeout": datetime.timedelta(seconds=options.retry_timeout_s),
    }
    return client, retry


def version_of(meta: Any) -> dict[str, str]:
    """The precondition of a conditional PUT on the object ``meta`` describes.

    S3 and Azure match the ETag; GCS matches the generation (``version``).
    """
    out = {"e_tag": str(meta["e_tag"])}
    if meta.get("version") is not None:
        out["version"] = str(meta["version"])
    return out


