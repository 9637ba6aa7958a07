"""Google Cloud Storage (via ``obstore``): ``gs://bucket/prefix``.

The commit protocol, leases and leftovers are those of every object store
(``_object.py``): data under a fresh root, the ``COMMITTED`` object last,
created with ``x-goog-if-generation-match: 0`` and leases renewed on the
generation last written. Credentials come from the usual ``GOOGLE_*``
environment variables (read by the client) or :class:`GCSOptions`; they are
never put in messages or reprs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from statestream.storage._object import ObjectStorage, TransferOptions, client_and_retry

__all__ = ["GCSOptions", "GCSStorage"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GCSOptions(TransferOptions):
    """Where and how to reach Google Cloud Storage (unset: ``GOOGLE_*`` environment).

    Attributes:
        service_account_path: a service account key file.
        service_account_key: the same key as JSON text (hidden in repr).
        application_credentials: an application default credentials file.
        bearer_token: a static OAuth token (hidden in repr).
        endpoint: another server, e.g. ``http://127.0.0.1:4443`` (obstore's ``base_url``).
        allow_http, part_bytes, max_concurrency, timeout_s, connect_timeout_s,
        max_retries, retry_timeout_s: as in :class:`S3Options`.
    """

    service_account_path: str | None = None
    service_account_key: str | None = dataclasses.field(default=None, repr=False)
    application_credentials: str | None = None
    bearer_token: str | None = dataclasses.field(default=None, repr=False)
    endpoint: str | None = None


class GCSStorage(ObjectStorage):
    """Checkpoints in Google Cloud Storage.

    Example:
        >>> "PRIVATE" in repr(GCSStorage(GCSOptions(service_account_key='{"PRIVATE": 1}')))
        False
    """

    scheme = "gs"
    env_prefixes = ("GOOGLE_",)
    credentials_hint = ("set GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT "
                        "(or pass GCSOptions)")
    timeout_hint = "GCSOptions.timeout_s / retry_timeout_s"
    list_permission = "storage.objects.list on the bucket"

    options: GCSOptions

    def __init__(self, options: GCSOptions | None = None) -> None:
        super().__init__(options or GCSOptions())

    def _new_store(self, bucket: str) -> Any:
        from obstore.store import GCSStore

        o = self.options
        names = {"service_account_path": "service_account",
                 "service_account_key": "service_account_key",
                 "application_credentials": "application_credentials",
                 "bearer_token": "bearer_token", "endpoint": "base_url"}
        kw: dict[str, Any] = {key: getattr(o, name) for name, key in names.items()
                              if getattr(o, name)}
        client, retry = client_and_retry(o, "GOOGLE_", o.endpoint)
        try:
            return GCSStore(bucket, client_options=client,  # type: ignore[arg-type]
                            retry_config=retry, **kw)  # type: ignore[arg-type]
        except Exception as exc:
            raise self._map_error(exc, f"configuring access to gs://{bucket}") from exc
