"""The shared storage conformance suite, run against local disk."""

from __future__ import annotations

import pathlib

import pytest

from statestream.storage import LocalStorage
from statestream.testing.storage import StorageTests


@pytest.fixture
def storage() -> LocalStorage:
    return LocalStorage()


@pytest.fixture
def base_url(tmp_path: pathlib.Path) -> str:
    return str(tmp_path)


class TestLocalConformance(StorageTests):
    pass
