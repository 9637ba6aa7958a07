"""Flatten nested containers to key paths, and rebuild them."""

from statestream.tree._flatten import (
    CONTAINER_KINDS,
    MAX_TREE_DEPTH,
    Node,
    PytreeExpansion,
    Stateful,
    flatten,
    is_stateful,
    rebuild_container,
    state_fields,
    type_name,
)
from statestream.tree._keypath import Key, KeyPath, format_keypath, match_keypath, parse_keypath

__all__ = [
    "CONTAINER_KINDS",
    "MAX_TREE_DEPTH",
    "Key",
    "KeyPath",
    "Node",
    "PytreeExpansion",
    "Stateful",
    "flatten",
    "format_keypath",
    "is_stateful",
    "match_keypath",
    "parse_keypath",
    "rebuild_container",
    "state_fields",
    "type_name",
]
