"""Object stores: a lease object renewed by conditional PUTs."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from statestream.errors import ManagerLockedError
from statestream.storage._object_config import version_of

if TYPE_CHECKING:
    from statestream.storage._object import ObjectStorage

__all__ = ["LEASE_SLACK_S", "ObjectLease", "parse_lease"]

#: Last-Modified has a resolution of one second; a lease is expired only past this slack.
LEASE_SLACK_S = 2.0


def parse_lease(data: bytes, default_ttl: float) -> tuple[str, float]:
    """(holder, ttl_s) of a lease object; a plain-text lock of older versions has ours."""
    try:
        doc = json.loads(data)
        return str(doc["holder"])[:200], float(doc["ttl_s"])
    except (ValueError, KeyError, TypeError):
        return data.decode(errors="replace")[:200] or "an unknown holder", default_ttl


class ObjectLease:
    """A lease object, renewed by a conditional PUT on the version we last wrote."""

    def __init__(self, owner: ObjectStorage, bucket: str, key: str, holder: str, ttl_s: float,
                 body: bytes, version: dict[str, str]) -> None:
        self._owner, self._bucket, self._key = owner, bucket, key
        self.holder = holder
        self.ttl_s: float | None = ttl_s
        self._body = body
        self._version = version

    def renew(self) -> None:
        version = self._owner._put_if(self._bucket, self._key, self._body, self._version)
        if version is None:  # refused: taken over, or our own renewal whose answer was lost
            version = self._owner._version_if_ours(self._bucket, self._key, self._body)
        if version is None:
            raise ManagerLockedError(
                f"{self._owner._url(self._bucket, self._key)} expired and was taken over by "
                "another holder"
            )
        self._version = version

    def release(self) -> None:
        import obstore

        st = self._owner._store(self._bucket)
        try:
            if version_of(obstore.head(st, self._key)) == self._version:  # still ours
                obstore.delete(st, self._key)
        except Exception:
            pass  # best effort: a lease not released expires after its ttl_s anyway


