"""PyTorch Lightning: statestream checkpoints through a ``CheckpointIO`` plugin.

``Trainer(plugins=[StatestreamCheckpointIO()])`` makes every checkpoint the
trainer writes (``ModelCheckpoint``'s top-k and ``last.ckpt``,
``trainer.save_checkpoint``) a statestream checkpoint: a directory named like
the file Lightning asked for (``epoch=3-step=40.ckpt/``), committed
atomically, with per-chunk checksums and no pickle. ``Trainer.fit(ckpt_path=...)``
and ``trainer.validate/test/predict(ckpt_path=...)`` read it back;
``ModelCheckpoint``'s top-k deletes old ones through
:meth:`StatestreamCheckpointIO.remove_checkpoint`. (``LightningModule.load_from_checkpoint``
calls ``torch.load`` itself: use ``load_checkpoint(path)["state_dict"]`` instead.)

Lightning's checkpoint dict (weights, optimizer and scheduler states, loop
progress, callback states under keys like ``"ModelCheckpoint{'monitor': ...}"``,
hyper-parameters) is made of tensors, plain values, dicts, lists and tuples,
all of which statestream stores without pickle; a callback's random generators
(``torch.Generator``, NumPy ``Generator``/``RandomState``, ``random.Random``, a
typed JAX key) are stored as their state and come back as generators. A value
that would not come back as it was (a namedtuple, dataclass or other pytree
node, which would load as a dict; an object with ``state_dict()``, which would
load as that state) or one of any other type (an object in the
hyper-parameters, a callback state holding a set) raises
:class:`~statestream.UnsupportedTypeError` naming its key path before anything
is written, unless the plugin was built with ``pickle=True``, which pickles just
those values; loading such a checkpoint then needs ``allow_pickle`` too:
``True``, or the key paths trusted to hold pickles
(``allow_pickle=["hyper_parameters"]``), as :func:`statestream.load` takes.

Saves and loads run on the calling process only (Lightning saves on global
rank 0 and loads on every rank), never as a collective.

Example (``async_save=True`` saves in the background, see
:class:`AsyncStatestreamCheckpointIO`)::

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from statestream.integrations.lightning import StatestreamCheckpointIO

    trainer = L.Trainer(max_epochs=4, plugins=[StatestreamCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True)])
    trainer.fit(model, data, ckpt_path="last")
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO

import statestream as ss
from statestream._gc import gc_paused
from statestream.api._open import open_checkpoint
from statestream.api._pickles import AllowPickle
from statestream.errors import CheckpointError, InvalidOptionTypeError
from statestream.format import DATA_DIR, FORMAT_NAME, MANIFEST_NAME
from statestream.integrations._lightning_state import inexact_values, load_target
from statestream.storage import storage_for
from statestream.storage._local import exchange_paths, fsync_dir

__all__ = ["AsyncStatestreamCheckpointIO", "StatestreamCheckpointIO"]

log = logging.getLogger(__name__)

_PATH = str | os.PathLike[str]


def _trusted(allow: AllowPickle) -> AllowPickle:
    """``allow_pickle`` checked when the plugin is built, not at the first load."""
    if isinstance(allow, bool):
        return allow
    paths = (allow,) if isinstance(allow, str) else tuple(allow)
    if not all(isinstance(p, str) for p in paths):
        raise InvalidOptionTypeError(
            "allow_pickle takes True, False or a collection of key paths (str), "
            f"not {allow!r}"
        )
    return paths


class StatestreamCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes statestream checkpoints.

    Args:
        async_save: save in the background with :func:`statestream.save_async`:
            ``save_checkpoint`` returns once the state is copied to host memory
            (training may go on), the write and commit finish later. A later
            save, a load or removal of the same path, and ``teardown`` wait for
            it; a failed background save raises on the next call.
        pickle: store values that have no pickle-free form that loads back as
            they were (a set, an object, a namedtuple, a dataclass, an object
            with ``state_dict()``) by pickling them (only those); without it they
            raise ``UnsupportedTypeError`` naming the key path.
        allow_pickle: let :meth:`load_checkpoint` unpickle such values:
            ``True`` (all of them), ``False`` (none), or a collection of key
            paths trusted to hold pickles, each covering its subtree
            (``["hyper_parameters"]``), as :func:`statestream.load` takes.
            Only for checkpoints you trust.
        io, memory: engine options (threads, request sizes, host memory budget).
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        pickle: bool = False,
        allow_pickle: AllowPickle = False,
        io: ss.IOOptions | None = None,
        memory: ss.MemoryOptions | None = None,
    ) -> None:
        super().__init__()
        self.async_save = async_save
        self.pickle = pickle
        self.allow_pickle = _trusted(allow_pickle)
        self.io = io
        self.memory = memory
        # each background save with what puts it in place once committed (or None)
        self._inflight: dict[str, list[tuple[ss.SaveHandle, _Finish | None]]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH,
                        storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` as a statestream checkpoint at ``path`` (replacing one there).

        Raises:
            InvalidOptionTypeError: ``storage_options`` were given (this plugin has none).
            UnsupportedTypeError: a value has no pickle-free form that loads back as it
                was, and ``pickle`` is off (nothing is written).
            CheckpointExistsError: ``path`` is something other than a checkpoint
                (a ``torch.save`` file, say): it is never replaced.
        """
        if storage_options is not None:
            raise InvalidOptionTypeError(
                f"{type(self).__name__} takes no storage_options; pass options to its "
                "constructor instead"
            )
        key = os.fspath(path)
        # what would not come back as it was: refused (or pickled) before anything is written
        checkpoint = inexact_values(checkpoint, type(self).__name__, pickle=self.pickle)
        self._reap(key, wait=os.path.islink(key))  # a link's replacement goes first
        where, finish = key, None
        if _replaceable_link(key):  # save_last="link" made it: replaced, its target kept
            where = _beside(key)
            if os.path.islink(where):  # a swap killed before the old link was removed
                os.unlink(where)
            finish = _Finish(where, key)
        else:
            if _interrupted_deletion(key):  # a killed removal's remains: replaced like the rest
                storage, spath = storage_for(key)
                storage.delete(spath)
            _drop_stale_side(key)
        kwargs: dict[str, Any] = {
            "overwrite": True,  # Lightning rewrites last.ckpt in place
            "pickle_paths": ["<root>"] if self.pickle else (),
            "io": self.io,
            "memory": self.memory,
            "collective": ss.SingleProcess(),
        }
        try:
            if self.async_save:
                handle = ss.save_async(where, checkpoint, **kwargs)
                with self._lock:
                    self._inflight.setdefault(key, []).append((handle, finish))
            else:
                ss.save(where, checkpoint, **kwargs)
        except ss.UnsupportedTypeError as exc:
            raise _plugin_hint(exc, type(self).__name__) from None
        if finish is not None and not self.async_save:
            finish(True)

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read the checkpoint at ``path``: tensors as torch tensors, generators and JAX
        keys as such (a JAX key when JAX is imported), the rest as saved.

        ``map_location`` may be a device (or its name) to put the tensors on;
        other forms (functions, dicts) load onto the CPU. ``weights_only`` is
        accepted for Lightning's sake: nothing is unpickled unless the plugin
        was built with ``allow_pickle`` (``True`` or the trusted key paths).

        Raises:
            FileNotFoundError: there is nothing at ``path`` (a
                ``CheckpointNotFoundError``, as Lightning expects).
        """
        key = os.fspath(path)
        self._reap(key, wait=True)
        device = _device_of(map_location)
        one = ss.SingleProcess()
        with gc_paused():  # a large manifest is many small objects (see statestream._gc)
            reader, manifest = open_checkpoint(key, follow=False)
            reader.close()
            target = load_target(manifest.tree, manifest, device)
        kw: dict[str, Any] = {"allow_pickle": self.allow_pickle, "memory": self.memory,
                              "collective": one}
        kept = ([k for k in _KEPT if k in target]
                if isinstance(target, dict) and device.type == "cpu"
                and all(isinstance(k, str) and k for k in target) else [])
        if not kept:
            state = ss.load(key, target, io=self.io, **kw)
        else:
            # The optimizers keep the tensors Lightning hands them as their state, and
            # the next step writes them all: read those, rather than map them (every
            # written page of a mapping is a fault and a copy; docs/design-notes.md).
            # The weights are copied into the module: they stay mapped.
            rest = [k for k in target if k not in kept]
            got = (ss.load(key, {k: target[k] for k in rest}, items=[_item(k) for k in rest],
                           io=self.io, **kw) if rest else {})
            read = dataclasses.replace(self.io or ss.IOOptions(), map_files=False)
            got.update(ss.load(key, {k: target[k] for k in kept},
                               items=[_item(k) for k in kept], io=read, **kw))
            state = {k: got[k] for k in target}
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{key} holds a {type(state).__name__} at its root, not a Lightning "
                "checkpoint dict"
            )
        return state

    # ------------------------------------------------------------------ remove
    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete the statestream checkpoint at ``path`` (its commit marker first).

        What a removal killed part-way left (its commit marker gone, files of it
        still there) is removed too. Anything else there (a ``torch.save`` file of
        an earlier run) is left alone with a warning in the log; a missing path is
        not an error.
        """
        key = os.fspath(path)
        self._reap(key, wait=True)
        storage, spath = storage_for(key)
        if storage.is_committed(spath) or _interrupted_deletion(key):
            storage.delete(spath)
            log.debug("removed checkpoint %s", key)
        elif "://" not in key and os.path.lexists(key):
            log.warning("%s is not a statestream checkpoint; left alone", key)

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Wait for every background save; raise the first one's error."""
        self._reap(None, wait=True)

    def teardown(self) -> None:
        """Called by Lightning at the end of fit/validate/test: waits for all saves.

        A failed save raises here, unless Lightning is tearing down because fit
        itself raised (this is called while that error is handled): raising then
        would replace the error that ended fit (it would only be the new one's
        ``__context__``), so the failed save is warned about instead."""
        ending = sys.exc_info()[1]
        if ending is None:
            self.wait()
            return
        try:
            self.wait()
        except Exception as exc:  # an interrupt still goes through
            warnings.warn(
                f"statestream: a checkpoint save failed ({type(exc).__name__}: {exc}) while "
                f"the run was ending with {type(ending).__name__}, which is raised",
                RuntimeWarning, stacklevel=2)

    def _reap(self, key: str | None, *, wait: bool) -> None:
        """Forget finished saves; with ``wait``, first wait for those of ``key`` (None: all).

        Raises the error of a failed save (each handle is reaped once).
        """
        with self._lock:
            pending = [(k, e) for k, es in self._inflight.items() for e in es]
        first: BaseException | None = None
        for k, (h, finish) in pending:
            if not (h.done() or (wait and key in (None, k))):
                continue
            ok = False
            try:
                h.result()
                ok = True
            except BaseException as exc:
                first = first or exc
            with self._lock:
                hs = self._inflight.get(k, [])
                if (h, finish) not in hs:
                    continue  # reaped meanwhile
                hs.remove((h, finish))
                if not hs:
                    self._inflight.pop(k, None)
            if finish is not None:
                try:
                    finish(ok)
                except BaseException as exc:
                    first = first or exc
        if first is not None:
            raise first


class AsyncStatestreamCheckpointIO(StatestreamCheckpointIO):
    """:class:`StatestreamCheckpointIO` with ``async_save=True``.

    Unlike Lightning's ``AsyncCheckpointIO`` (a thread that clones every
    tensor first), the copy out of the state happens in statestream's staging
    pool, within its host memory budget, before ``save_checkpoint`` returns.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("async_save", True)
        super().__init__(**kwargs)


#: A data file's name in a checkpoint's ``data/`` (``r<rank>-<n>.bin`` and the like).
_DATA_FILE = re.compile(r"^r\d+-\d+[.\w-]*$")


def _plugin_hint(exc: ss.UnsupportedTypeError, plugin: str) -> ss.UnsupportedTypeError:
    """``exc`` with the plugin's way to store such a value: the library's error says to
    pass ``pickle_paths`` to ``save()``, which a Lightning user never calls."""
    text = str(exc).split("; to store it anyway", 1)[0]
    return ss.UnsupportedTypeError(
        f"{text}; to store it anyway, build the plugin with {plugin}(pickle=True) "
        "(loading it then needs allow_pickle=True, or the key paths trusted to hold "
        "pickles)")


def _interrupted_deletion(key: str) -> bool:
    """Whether ``key`` is what a killed deletion of a statestream checkpoint left.

    Locally: a directory without a commit marker (a deletion removes it first) that
    holds nothing but a statestream manifest and data files (or their empty ``data/``).
    On an object store: the deletion's mark and no commit marker (the backend's
    ``deletion_interrupted``; objects without the mark may be a save in flight).

    Such remains load as nothing and are no one else's: :meth:`remove_checkpoint`
    removes them and a save replaces them (storage refuses to replace an uncommitted
    directory, which could be anyone's; an object store would keep them as garbage).
    """
    if "://" in key:
        storage, spath = storage_for(key)
        probe = getattr(storage, "deletion_interrupted", None)
        return bool(probe is not None and probe(spath))
    if os.path.islink(key) or not os.path.isdir(key):
        return False
    try:
        names = set(os.listdir(key))
        data = os.path.join(key, DATA_DIR)
        files = os.listdir(data) if DATA_DIR in names else []
        if not names or not names <= {MANIFEST_NAME, DATA_DIR} or not all(
                _DATA_FILE.match(f) and os.path.isfile(os.path.join(data, f)) for f in files):
            return False
        if MANIFEST_NAME in names:
            with open(os.path.join(key, MANIFEST_NAME), "rb") as f:
                return f.read(64).startswith(b'{"format":"%s",' % FORMAT_NAME.encode())
        return True
    except OSError:
        return False


def _replaceable_link(key: str) -> bool:
    """Whether ``key`` is a symbolic link a save replaces: one to a committed statestream
    checkpoint (``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` one), to what
    a killed removal of one left, or to nothing. A link to anything else is left to the
    storage, which refuses it."""
    if "://" in key or not os.path.islink(key):
        return False
    if not os.path.exists(key):
        return True
    storage, spath = storage_for(key)
    return storage.is_committed(spath) or _interrupted_deletion(os.path.realpath(key))


def _beside(key: str) -> str:
    """Where a save that replaces the link ``key`` is written before it takes its place
    (hidden: Lightning's search for ``last*.ckpt`` passes it over)."""
    parent, name = os.path.split(os.path.abspath(key))
    return os.path.join(parent, f".{name}.relink")


def _drop_stale_side(key: str) -> None:
    """Remove what a save that replaced the link ``key`` left beside it when killed
    between its commit and the swap (or mid-swap: the old link), once ``key`` is no
    longer such a link (nothing else would ever remove it)."""
    if "://" in key or os.path.islink(key):
        return
    side = _beside(key)
    if os.path.islink(side):
        os.unlink(side)
    elif os.path.isdir(side):
        storage, spath = storage_for(side)
        if storage.is_committed(spath) or _interrupted_deletion(side):
            storage.delete(spath)


class _Finish:
    """Puts a checkpoint saved beside a link in the link's place once committed: one
    atomic swap (renameat2), else unlink and rename; the link itself is removed, never
    what it pointed to. A failed save's remains go, and so does a background save whose
    link Lightning replaced meanwhile (``save_last="link"`` links the newer one)."""

    def __init__(self, saved: str, link: str) -> None:
        self.saved, self.link = saved, link
        self.points_to = os.readlink(link)

    def __call__(self, ok: bool) -> None:
        if ok and not self._link_unchanged():
            # Lightning linked it anew meanwhile (save_last="link"): that is newer
            log.debug("%s was replaced while a save to it ran; that save is dropped", self.link)
            ok = False
        if not ok:
            shutil.rmtree(self.saved, ignore_errors=True)
            return
        parent = os.path.dirname(os.path.abspath(self.link))
        if exchange_paths(self.saved, self.link):
            os.unlink(self.saved)  # the link, now
        else:
            if os.path.islink(self.link):
                os.unlink(self.link)
            os.rename(self.saved, self.link)
        fsync_dir(parent)

    def _link_unchanged(self) -> bool:
        try:
            return os.readlink(self.link) == self.points_to
        except OSError:  # gone, or no longer a link
            return False


#: Top-level keys of a Lightning checkpoint whose tensors become an object's state.
_KEPT = ("optimizer_states",)


def _item(key: str) -> str:
    """A top-level key as a key path (``~`` and ``/`` escaped)."""
    return key.replace("~", "~0").replace("/", "~1")


def _device_of(map_location: Any) -> torch.device:
    if isinstance(map_location, torch.device):
        return map_location
    if isinstance(map_location, str):
        return torch.device(map_location)
    return torch.device("cpu")
