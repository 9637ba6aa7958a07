"""A new framework is one provider: ``ss.register_provider`` and the typed protocol."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.providers import (
    ArrayProvider,
    Destination,
    NumpyProvider,
    PreparedArray,
    ProviderCapabilities,
    array_provider_for,
    provider_by_kind,
    providers,
    target_provider_for,
)
from statestream.providers.numpy import prepare_host_array
from statestream.tree import KeyPath


class Boxed:
    """A toy framework's array: a NumPy array in a box."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data


class BoxedProvider(ArrayProvider):
    kind = "boxed-test"
    capabilities = ProviderCapabilities()

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, Boxed)

    def prepare(self, obj: Any, path: KeyPath) -> PreparedArray:
        return prepare_host_array(obj.data, path, self.kind)

    def is_target(self, like: Any) -> bool:
        return isinstance(like, Boxed)

    def target_shape(self, like: Any) -> tuple[int, ...]:
        return tuple(like.data.shape)

    def restore(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                scalar: bool = False) -> Destination:
        inner = NumpyProvider().restore(dtype, shape, None, path)
        return Destination(boxes=inner.boxes, finish=lambda: Boxed(inner.finish()))


_PROVIDER = BoxedProvider()
ss.register_provider(_PROVIDER, module=__name__)


def test_registered_provider_saves_and_restores(tmp_path) -> None:
    assert array_provider_for(Boxed(np.zeros(1))) is _PROVIDER
    assert target_provider_for(Boxed(np.zeros(1))) is _PROVIDER
    assert provider_by_kind("boxed-test") is _PROVIDER  # its module is loaded
    assert _PROVIDER in providers()
    state = {"w": Boxed(np.arange(6.0).reshape(2, 3)), "n": np.ones(2)}
    ss.save(tmp_path / "c", state)
    out = ss.load(tmp_path / "c")  # no target: NumPy, as for every kind
    np.testing.assert_array_equal(out["w"], state["w"].data)
    got = ss.load(tmp_path / "c", target={"w": Boxed(np.zeros((2, 3))), "n": np.zeros(2)})
    assert isinstance(got["w"], Boxed)
    np.testing.assert_array_equal(got["w"].data, state["w"].data)


def test_a_target_whose_shape_the_provider_cannot_read_names_its_key_path(tmp_path) -> None:
    ss.save(tmp_path / "c", {"m": {"w": Boxed(np.zeros(3))}})
    # target_shape raises AttributeError ('NoneType' object has no attribute 'shape'):
    # a target that does not fit, named, not the provider's raw error
    with pytest.raises(ss.TargetMismatchError, match="AttributeError") as ei:
        ss.load(tmp_path / "c", {"m": {"w": Boxed(None)}})  # type: ignore[arg-type]
    assert "key path 'm/w'" in str(ei.value) and "BoxedProvider" in str(ei.value)


def test_registering_twice_or_a_non_provider_is_refused() -> None:
    with pytest.raises(ss.UnsupportedTypeError, match="already registered"):
        ss.register_provider(BoxedProvider())
    with pytest.raises(ss.UnsupportedTypeError, match="not a statestream.providers"):
        ss.register_provider(object())  # type: ignore[arg-type]


def test_abstract_methods_are_required() -> None:
    class Half(ArrayProvider):
        kind = "half"

        def handles(self, obj: Any) -> bool:
            return False

    with pytest.raises(TypeError):
        Half()  # type: ignore[abstract]


def test_guarding_an_unknown_optimizer_is_an_error(tmp_path) -> None:
    h = ss.save_async(tmp_path / "c", {"w": np.ones(3)})
    h.result()
    with pytest.raises(ss.UnsupportedTypeError, match="cannot guard"):
        ss.guard_optimizer(object(), h)


def test_wait_for_unknown_values_waits_for_the_whole_snapshot(tmp_path) -> None:
    # A value whose memory cannot be told must never skip the wait (it used to be
    # skipped silently when reading its address failed).
    h = ss.save_async(tmp_path / "c", {"w": np.ones(1000)}, lazy=True)
    h.wait_for([object()])
    assert h.snapshot_done()
    h.result()
