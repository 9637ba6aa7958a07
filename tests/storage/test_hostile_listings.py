"""Listings a store (or a proxy in front of it) gets wrong: keys outside the prefix asked
for, a continuation token that repeats, a folder marker. Against moto's S3 server, through
a small HTTP proxy on loopback that rewrites its listing answers."""

from __future__ import annotations

import itertools
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.cli._main import main as cli_main
from statestream.storage import S3Options, S3Storage, set_backend, storage_for

#: rewrites (request line, answer body) -> the body to send, or None to leave it
Rewrite = Callable[[bytes, bytes], "bytes | None"]


def _read(sock: socket.socket, head_only: bool) -> tuple[list[bytes], bytes] | None:
    """One HTTP message (lines of its head, body) read from ``sock``; None at its end."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(1 << 16)
        if not data:
            return None
        buf += data
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    size = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and not head_only:
            size = int(value)
    while len(body) < size:
        data = sock.recv(1 << 16)
        if not data:
            break
        body += data
    return lines, body


class RewritingProxy:
    """Forwards each request to ``upstream`` (one connection each) and passes its answer
    through ``rewrite``; ``request`` may rewrite the request line first."""

    def __init__(self, upstream_port: int, rewrite: Rewrite,
                 request: Callable[[bytes], bytes] = lambda line: line) -> None:
        self._upstream, self._rewrite, self._request = upstream_port, rewrite, request
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                while (got := _read(client, False)) is not None:
                    lines, body = got
                    lines[0] = self._request(lines[0])
                    lines = [x for x in lines if not x.lower().startswith(b"connection:")]
                    with socket.create_connection(("127.0.0.1", self._upstream)) as up:
                        up.sendall(b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"
                                   + body)
                        answer = _read(up, lines[0].startswith(b"HEAD"))
                    if answer is None:
                        return
                    head, data = answer
                    new = self._rewrite(lines[0], data)
                    keep = [x for x in head if not x.lower().startswith(
                        (b"connection:", b"content-length:" if new is not None else b"\0"))]
                    if new is not None:
                        keep.append(b"Content-Length: %d" % len(new))
                    client.sendall(b"\r\n".join(keep) + b"\r\n\r\n" + (data if new is None
                                                                        else new))
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def _is_listing(line: bytes) -> bool:
    return line.startswith(b"GET ") and b"list-type=2" in line


@pytest.fixture
def direct(s3_server: dict[str, Any]) -> Iterator[S3Storage]:
    st = S3Storage(S3Options(endpoint=s3_server["endpoint"], region="us-east-1",
                             access_key_id=s3_server["aws_access_key_id"],
                             secret_access_key=s3_server["aws_secret_access_key"]))
    set_backend("s3", st)
    try:
        yield st
    finally:
        set_backend("s3", None)


def _via(s3_server: dict[str, Any], proxy: RewritingProxy, **kw: Any) -> S3Storage:
    st = S3Storage(S3Options(endpoint=f"http://127.0.0.1:{proxy.port}", region="us-east-1",
                             access_key_id=s3_server["aws_access_key_id"],
                             secret_access_key=s3_server["aws_secret_access_key"],
                             max_retries=0, **kw))
    set_backend("s3", st)
    return st


def test_a_listing_with_keys_outside_its_prefix_deletes_none_of_them(
        s3_server: dict[str, Any], direct: S3Storage) -> None:
    """A store that does not apply a listing's prefix (or a proxy that mixes answers up):
    deleting a checkpoint deleted every object the listing of its prefix named, someone
    else's too, and ls showed them as entries. It is now a StorageError naming the key."""
    bucket, client = s3_server["bucket"], s3_server["client"]
    run = f"hostile-{uuid.uuid4().hex[:8]}"
    victim = f"other-{uuid.uuid4().hex[:8]}/precious"
    client.put_object(Bucket=bucket, Key=victim, Body=b"keep me")
    url = f"s3://{bucket}/{run}"
    ss.save(f"{url}/ck", {"w": np.ones(3)})
    extra = (f"<Contents><Key>{victim}</Key><LastModified>2026-01-01T00:00:00.000Z"
             "</LastModified><ETag>&quot;0&quot;</ETag><Size>7</Size>"
             "<StorageClass>STANDARD</StorageClass></Contents>").encode()

    def rewrite(line: bytes, body: bytes) -> bytes | None:
        return body.replace(b"</ListBucketResult>", extra + b"</ListBucketResult>") \
            if _is_listing(line) else None

    proxy = RewritingProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]), rewrite)
    try:
        st = _via(s3_server, proxy)
        for call in (lambda: st.list(url), lambda: st.leftovers(url),
                     lambda: ss.verify(f"{url}/ck"), lambda: st.delete(f"{url}/ck")):
            with pytest.raises(ss.StorageError, match="not under it") as ei:
                call()
            assert f"s3://{bucket}/{victim}" in str(ei.value)
    finally:
        proxy.close()
        set_backend("s3", direct)
    assert client.get_object(Bucket=bucket, Key=victim)["Body"].read() == b"keep me"


@pytest.mark.timeout(60)
def test_a_listing_whose_continuation_token_repeats_fails_instead_of_looping(
        s3_server: dict[str, Any], direct: S3Storage) -> None:
    """Every answer says there is more, with the same token: the client lists the same
    page forever (deleting a checkpoint, gc, verify never returned). It now stops at the
    first key listed twice."""
    bucket = s3_server["bucket"]
    url = f"s3://{bucket}/loop-{uuid.uuid4().hex[:8]}"
    ss.save(f"{url}/ck", {"w": np.ones(3)})

    def rewrite(line: bytes, body: bytes) -> bytes | None:
        if not _is_listing(line) or b"delimiter" in line:
            return None  # (a listing with a delimiter: see the tests below)
        return body.replace(b"<IsTruncated>false</IsTruncated>",
                            b"<IsTruncated>true</IsTruncated>"
                            b"<NextContinuationToken>again</NextContinuationToken>")

    proxy = RewritingProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]), rewrite,
                           lambda line: re.sub(rb"continuation-token=[^& ]*&?", b"", line))
    try:
        st = _via(s3_server, proxy)
        for call in (lambda: st.leftovers(url), lambda: ss.verify(f"{url}/ck"),
                     lambda: st.delete(f"{url}/ck")):
            with pytest.raises(ss.StorageError, match="twice") as ei:
                call()
            assert f"{url}/ck/" in str(ei.value)
    finally:
        proxy.close()
        set_backend("s3", direct)


def _forever(line: bytes, body: bytes, *, empty: bool, delimited: bool) -> bytes | None:
    """A listing answer that says there is more, with the same token each time; its
    objects left out when ``empty``. Listings with (``delimited``) or without a delimiter."""
    if not _is_listing(line) or (b"delimiter" in line) != delimited:
        return None
    if empty:
        body = re.sub(rb"<(Contents|CommonPrefixes)>.*?</\1>", b"", body, flags=re.S)
        body = re.sub(rb"<KeyCount>\d+</KeyCount>", b"<KeyCount>0</KeyCount>", body)
    return body.replace(b"<IsTruncated>false</IsTruncated>",
                        b"<IsTruncated>true</IsTruncated>"
                        b"<NextContinuationToken>again</NextContinuationToken>")


def _drop_token(line: bytes) -> bytes:
    return re.sub(rb"continuation-token=[^& ]*&?", b"", line)


#: the options of a store behind a looping proxy: a listing that hands back nothing is
#: given up after 2 * (timeout_s + retry_timeout_s) = 6 s
_SHORT = {"timeout_s": 2.0, "retry_timeout_s": 1.0}


@pytest.mark.timeout(120, method="thread")
def test_a_listing_whose_repeated_pages_are_empty_fails_instead_of_looping(
        s3_server: dict[str, Any], direct: S3Storage) -> None:
    """Every answer is empty and says there is more, with the same token: the client
    (obstore) pages by itself and hands nothing back, so no key is listed twice --
    deleting a checkpoint, leftovers, verify never returned (about 250 requests a second
    until the process ended). A listing that hands back nothing for longer than a request
    may take is now a StorageError naming it."""
    bucket = s3_server["bucket"]
    url = f"s3://{bucket}/empty-loop-{uuid.uuid4().hex[:8]}"
    ss.save(f"{url}/ck", {"w": np.ones(3)})
    proxy = RewritingProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]),
                           lambda line, body: _forever(line, body, empty=True, delimited=False),
                           _drop_token)
    try:
        st = _via(s3_server, proxy, **_SHORT)
        for call in (lambda: st.leftovers(url), lambda: ss.verify(f"{url}/ck"),
                     lambda: st.delete(f"{url}/ck"), lambda: st.check_bucket(bucket)):
            with pytest.raises(ss.StorageError, match="without end") as ei:
                call()
            assert f"listing s3://{bucket}/" in str(ei.value)
    finally:
        proxy.close()
        set_backend("s3", direct)


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("empty", [False, True])
def test_a_listing_of_names_whose_token_repeats_fails_instead_of_looping(
        s3_server: dict[str, Any], direct: S3Storage, empty: bool) -> None:
    """The listing with a delimiter (the names under a directory: steps(), latest_step(),
    ``statestream ls``) is paged by the client, which returns only after the last page:
    with a token that repeats it never returned, its pages' objects or not. It is now a
    StorageError naming the directory."""
    bucket = s3_server["bucket"]
    url = f"s3://{bucket}/names-loop-{uuid.uuid4().hex[:8]}"
    with ss.CheckpointManager(url, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(3)})
    proxy = RewritingProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]),
                           lambda line, body: _forever(line, body, empty=empty, delimited=True),
                           _drop_token)
    try:
        st = _via(s3_server, proxy, **_SHORT)
        with pytest.raises(ss.StorageError, match="did not finish") as ei:
            st.list(url)
        assert f"listing {url}/ failed" in str(ei.value)
        with pytest.raises(ss.StorageError, match="did not finish"):
            ss.CheckpointManager(url, async_save=False).steps()
        assert cli_main(["ls", url]) != 0
    finally:
        proxy.close()
        set_backend("s3", direct)


@pytest.mark.timeout(60)
def test_a_listing_whose_tokens_cycle_fails_instead_of_looping(
        s3_server: dict[str, Any], direct: S3Storage) -> None:
    """Tokens that loop (a, b, a, ...) rather than repeat at once: the first page comes
    again, its first key is listed twice."""
    bucket = s3_server["bucket"]
    url = f"s3://{bucket}/cycle-{uuid.uuid4().hex[:8]}"
    ss.save(f"{url}/ck", {"w": np.ones(3)})

    answers = itertools.count()

    def rewrite(line: bytes, body: bytes) -> bytes | None:
        if not _is_listing(line) or b"delimiter" in line:
            return None
        nxt = b"ab"[next(answers) % 2:][:1]  # a, b, a, b, ...
        return body.replace(b"<IsTruncated>false</IsTruncated>",
                            b"<IsTruncated>true</IsTruncated><NextContinuationToken>"
                            + nxt + b"</NextContinuationToken>")

    proxy = RewritingProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]), rewrite,
                           _drop_token)
    try:
        st = _via(s3_server, proxy)
        with pytest.raises(ss.StorageError, match="twice") as ei:
            st.leftovers(url)
        assert f"{url}/ck/" in str(ei.value)
    finally:
        proxy.close()
        set_backend("s3", direct)


def test_a_folder_marker_is_no_entry(s3_server: dict[str, Any], direct: S3Storage) -> None:
    """A console's "create folder" writes the object ``run/``, which the client lists as
    ``run``: ls of ``run`` showed an entry named like the directory itself."""
    bucket = s3_server["bucket"]
    run = f"folder-{uuid.uuid4().hex[:8]}"
    s3_server["client"].put_object(Bucket=bucket, Key=f"{run}/", Body=b"")
    url = f"s3://{bucket}/{run}"
    with ss.CheckpointManager(url, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(3)})
        assert mgr.steps() == [1]
    assert storage_for(url)[0].list(url) == ["step_0000000001"]
    assert storage_for(url)[0].leftovers(url) == []
