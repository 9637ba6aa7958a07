"""Azure Blob Storage (via ``obstore``): ``az://container/prefix``.

The commit protocol, leases and leftovers are those of every object store
(``_object.py``): data under a fresh root, the ``COMMITTED`` blob last,
created with ``If-None-Match: *`` and leases renewed with ``If-Match``.
Credentials come from the usual ``AZURE_STORAGE_*`` environment variables
(read by the client) or :class:`AzureOptions`; they are never put in
messages or reprs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from statestream.errors import StorageError
from statestream.storage._object import ObjectStorage, TransferOptions, client_and_retry

__all__ = ["AzureOptions", "AzureStorage"]

#: Azure's container names: 3-63 lowercase letters, digits and single hyphens between
#: them, or one of the service's own containers. The service answers any other with a
#: bare 400 (no code in the message a HEAD gets), so they are refused before a request.
_CONTAINER_RE = re.compile(r"^(?:\$root|\$web|\$logs|[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62})$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AzureOptions(TransferOptions):
    """Where and how to reach Azure Blob Storage (unset: ``AZURE_*`` environment).

    Attributes:
        account_name: the storage account.
        account_key: its shared key (hidden in repr).
        sas_token: a shared access signature, ``sv=...&sig=...`` (hidden in repr).
        client_id, client_secret, tenant_id: a service principal (secret hidden).
        endpoint: e.g. ``http://127.0.0.1:10000/devstoreaccount1`` for Azurite.
        use_emulator: Azurite's well-known account and key at ``127.0.0.1:10000``.
        allow_http, part_bytes, max_concurrency, timeout_s, connect_timeout_s,
        max_retries, retry_timeout_s: as in :class:`S3Options` (``part_bytes`` is
        the block size of a block blob).
    """

    account_name: str | None = None
    account_key: str | None = dataclasses.field(default=None, repr=False)
    sas_token: str | None = dataclasses.field(default=None, repr=False)
    client_id: str | None = None
    client_secret: str | None = dataclasses.field(default=None, repr=False)
    tenant_id: str | None = None
    endpoint: str | None = None
    use_emulator: bool = False


class AzureStorage(ObjectStorage):
    """Checkpoints in Azure Blob Storage (or Azurite).

    Example:
        >>> "hunter2" in repr(AzureStorage(AzureOptions(account_key="hunter2")))
        False
    """

    scheme = "az"
    bucket_word = "container"
    env_prefixes = ("AZURE_", "AZURITE_")
    credentials_hint = ("set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or "
                        "AZURE_STORAGE_SAS_TOKEN; or pass AzureOptions)")
    timeout_hint = "AzureOptions.timeout_s / retry_timeout_s"
    missing_bucket_codes = ("<code>containernotfound</code>",)
    list_permission = ("the List permission on the container ('l' in a SAS token's sp=; "
                       "with Microsoft Entra ID, a role such as Storage Blob Data Reader)")

    options: AzureOptions

    def __init__(self, options: AzureOptions | None = None) -> None:
        super().__init__(options or AzureOptions())

    def split_url(self, url: str) -> tuple[str, str]:
        """As every object store's, and a backslash is refused: Azure Blob Storage (and
        Azurite) store ``\\`` as ``/``, so ``az://box/run/a\\b`` would be written to
        ``run/a/b``, and ``a\\\\b`` or ``a\\..\\b`` to names with empty or ``..``
        segments, which no listing of ``run/`` can read back."""
        container, prefix = super().split_url(url)
        if not _CONTAINER_RE.match(container):
            raise StorageError(
                f"{url!r}: {container!r} is no Azure container name (3-63 lowercase letters, "
                "digits and hyphens, starting and ending with a letter or digit, no '--')")
        if "\\" in prefix:
            raise StorageError(
                f"{url!r} has a backslash: Azure Blob Storage stores '\\' as '/', so it "
                "would name another path; use '/'")
        return container, prefix

    def _new_store(self, bucket: str) -> Any:
        from obstore.store import AzureStore

        o = self.options
        names = {"account_name": "account_name", "account_key": "account_key",
                 "sas_token": "sas_key", "client_id": "client_id",
                 "client_secret": "client_secret", "tenant_id": "tenant_id",
                 "endpoint": "endpoint"}
        kw: dict[str, Any] = {key: getattr(o, name) for name, key in names.items()
                              if getattr(o, name)}
        if o.use_emulator:
            kw["use_emulator"] = True
        client, retry = client_and_retry(o, "AZURE_", o.endpoint)
        try:
            return AzureStore(bucket, client_options=client,  # type: ignore[arg-type]
                              retry_config=retry, **kw)  # type: ignore[arg-type]
        except Exception as exc:
            raise self._map_error(exc, f"configuring access to az://{bucket}") from exc
