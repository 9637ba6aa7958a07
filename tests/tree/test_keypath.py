"""Tests for statestream.tree._keypath: display form and parsing of key paths."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statestream.tree import format_keypath, match_keypath, parse_keypath


def test_root_formats_as_placeholder_and_parses_back_empty() -> None:
    assert format_keypath(()) == "<root>"
    assert parse_keypath("<root>") == ()
    assert parse_keypath("") == ()


def test_int_keys_format_as_decimal() -> None:
    assert format_keypath(("layers", 3, "w")) == "layers/3/w"
    assert parse_keypath("layers/3/w") == ("layers", "3", "w")


def test_escaping_of_slash_and_tilde() -> None:
    assert format_keypath(("a/b", "c~d")) == "a~1b/c~0d"
    # "~1" written literally must survive: "~" is escaped first
    assert format_keypath(("~1",)) == "~01"
    assert parse_keypath("~01") == ("~1",)
    assert parse_keypath("a~1b/c~0d") == ("a/b", "c~d")


def test_dots_and_unicode_are_kept_verbatim() -> None:
    path = ("c.d", "ünïcödé", "日本", "e.f.g")
    text = format_keypath(path)
    assert text == "c.d/ünïcödé/日本/e.f.g"
    assert parse_keypath(text) == path


def test_empty_segments_inside_a_path_round_trip() -> None:
    assert parse_keypath(format_keypath(("a", "", "b"))) == ("a", "", "b")


_key = st.text(alphabet=st.sampled_from(["a", "/", "~", "0", "1", ".", "é", "😀", " "]),
               max_size=6)


@given(st.lists(_key, min_size=1, max_size=6))
def test_round_trip_property(path: list[str]) -> None:
    # The single-segment paths "" and "<root>" display like the root itself.
    if path in ([""], ["<root>"]):
        return
    assert parse_keypath(format_keypath(tuple(path))) == tuple(path)


@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=5))
def test_int_paths_round_trip_as_strings(path: list[int]) -> None:
    assert parse_keypath(format_keypath(tuple(path))) == tuple(str(i) for i in path)


@pytest.mark.parametrize(("pattern", "path", "hit"), [
    ("opt/**", ("opt", "m", "w"), True),
    ("opt", ("opt", "m", "w"), True),
    ("opt/*", ("opt", "m", "w"), True),
    ("opt/**", ("optim", "m"), False),
    ("**", ("a",), True),
    ("**/bias", ("model", "layers", 3, "bias"), True),
    ("**/bias", ("model", "bias_scale"), False),
    ("model/layers/*/w*", ("model", "layers", 3, "weight"), True),
    ("model/layers/?/w", ("model", "layers", 12, "w"), False),
    ("a~1b/c", ("a/b", "c", "d"), True),
    ("a/**/z", ("a", "z"), True),
    ("a/**/z", ("a", "x", "y", "z", "q"), True),
    ("a/**/z", ("a", "x", "y"), False),
    ("params", ("opt",), False),
    ("x/y", ("x",), False),
])
def test_match_keypath(pattern: str, path: tuple[object, ...], hit: bool) -> None:
    assert match_keypath(pattern, path) is hit  # type: ignore[arg-type]
