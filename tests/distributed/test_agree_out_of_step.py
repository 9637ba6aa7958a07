"""The agreement helpers check what their peers sent: a message of another
operation (a rank out of step) or a malformed one raises DistributedError naming
the rank and phase, never TypeError/IndexError/KeyError (fake collectives)."""

from __future__ import annotations

from typing import Any

import pytest

from statestream.distributed import agree, any_of, gather_each, share_from_0
from statestream.errors import DistributedError


class _Peer:
    """A 2-rank collective (this is rank 0) whose rank 1 sends ``sent`` (or whose
    gathers return ``whole``)."""

    rank = 0
    world_size = 2

    def __init__(self, sent: Any, whole: Any = None) -> None:
        self.sent, self.whole = sent, whole

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.whole if self.whole is not None else [obj, self.sent]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj


#: what other operations (or other libraries) put where an agreement's message goes
MALFORMED = [None, "ValueError: x", ["phase"], ["phase", None], [1, None, None],
             ["x", 3, None], {"phase": "x"}, ["x", None, None, None], 7]

HELPERS = [
    ("agree", lambda c: agree(c, "save of step 2", None), "nothing was committed"),
    ("gather_each", lambda c: gather_each(c, "save of step 2", lambda: 1),
     "nothing was changed"),
    ("share_from_0", lambda c: share_from_0(c, "save of step 2", lambda: 1),
     "nothing was changed"),
    ("any_of", lambda c: any_of(c, "save of step 2", False), "nothing was changed"),
]


@pytest.mark.parametrize("sent", MALFORMED, ids=repr)
@pytest.mark.parametrize("name,call,outcome", HELPERS, ids=[h[0] for h in HELPERS])
def test_a_malformed_peer_message_is_a_distributed_error(sent: Any, name: str, call: Any,
                                                        outcome: str) -> None:
    with pytest.raises(DistributedError) as ei:
        call(_Peer(sent))
    msg = str(ei.value)
    assert "rank 1 sent" in msg and "save of step 2" in msg, msg
    assert msg.endswith(outcome), msg


@pytest.mark.parametrize("whole", [{"a": 1}, [["save of step 2", None, 1]], "xy", 3],
                         ids=repr)
@pytest.mark.parametrize("name,call,outcome", HELPERS, ids=[h[0] for h in HELPERS])
def test_a_gather_of_the_wrong_shape_is_a_distributed_error(whole: Any, name: str, call: Any,
                                                           outcome: str) -> None:
    with pytest.raises(DistributedError, match="not one message from each of the 2 ranks"):
        call(_Peer(None, whole=whole))


def test_a_collective_that_gathers_into_a_tuple_is_fine() -> None:
    whole = (["save of step 2", None, 4], ["save of step 2", None, 5])
    assert gather_each(_Peer(None, whole=whole), "save of step 2",  # type: ignore[arg-type]
                       lambda: 4) == [4, 5]


@pytest.mark.parametrize("name,call,outcome", HELPERS, ids=[h[0] for h in HELPERS])
def test_a_peer_in_another_phase_is_named(name: str, call: Any, outcome: str) -> None:
    with pytest.raises(DistributedError) as ei:
        call(_Peer(["keep policy of close()", None, None]))
    msg = str(ei.value)
    assert ("rank 0 was in 'save of step 2', rank 1 in 'keep policy of close()'"
            in msg), msg
    assert msg.endswith(outcome), msg


def test_the_local_error_is_chained_when_the_ranks_are_out_of_step() -> None:
    with pytest.raises(DistributedError, match="ranks out of step") as ei:
        agree(_Peer(["other", None, None]), "mine", KeyError("k"))  # type: ignore[arg-type]
    assert isinstance(ei.value.__cause__, KeyError)
    assert str(ei.value).startswith("rank 0 failed during 'mine': KeyError: 'k'; ")


def test_a_failure_is_named_first_with_its_own_phase_when_the_phases_differ() -> None:
    """One rank's own argument (its step) differs from the others' and fails its check:
    the phases that name the steps differ too; its failure comes first."""
    with pytest.raises(DistributedError) as ei:
        gather_each(_Peer(["checking step 1", "CheckpointError: step 1 < 2", None]),  # type: ignore[arg-type]
                    "checking step 3", lambda: 3)
    msg = str(ei.value)
    assert msg.startswith("rank 1 failed during 'checking step 1': CheckpointError: step 1 < 2; "
                          "ranks out of step: "), msg
    assert "rank 0 was in 'checking step 3', rank 1 in 'checking step 1'" in msg, msg
    assert msg.endswith("nothing was changed"), msg
    assert ei.value.failed_types == ("CheckpointError",)


class _Reduce(_Peer):
    """A peer with the all-reduce fast path, in phase ``theirs``."""

    def __init__(self, theirs: str, failed: bool = False) -> None:
        super().__init__([theirs, "ValueError: x" if failed else None, None])
        self.theirs, self.failed, self.calls = theirs, failed, []  # type: list[str]

    def max_ints(self, values: list[int]) -> list[int]:
        from statestream.distributed._agree import _phase_tag

        self.calls.append("max_ints")
        t = _phase_tag(self.theirs)
        return [max(a, b) for a, b in zip(values, [int(self.failed), t, -t])]

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append("all_gather_object")
        return super().all_gather_object(obj)


def test_the_fast_path_tells_phases_apart_and_gathers_only_then() -> None:
    same = _Reduce("planning")
    agree(same, "planning", None)  # type: ignore[arg-type]
    assert same.calls == ["max_ints"]
    other = _Reduce("committing")
    with pytest.raises(DistributedError,
                       match="rank 0 was in 'planning', rank 1 in 'committing'"):
        agree(other, "planning", None)  # type: ignore[arg-type]
    assert other.calls == ["max_ints", "all_gather_object"]
    flagged = _Reduce("planning", failed=True)
    assert any_of(flagged, "planning", False) is True  # type: ignore[arg-type]
    assert flagged.calls == ["max_ints"]
    with pytest.raises(DistributedError,
                       match="rank 0 was in 'planning', rank 1 in 'committing'"):
        any_of(_Reduce("committing"), "planning", False)  # type: ignore[arg-type]
    failed = _Reduce("planning", failed=True)
    with pytest.raises(DistributedError, match="rank 1 failed during planning: ValueError"):
        agree(failed, "planning", None)  # type: ignore[arg-type]


def test_check_as_is_compared_in_place_of_a_phase_that_names_a_node_local_path() -> None:
    """A node-local directory may have another path on each node: the ranks compare
    what ``check_as`` says, and the failures still name this rank's own path."""
    peer = _Peer(["identifying the node-local directory", None, None])
    agree(peer, "identifying the node-local directory /n0/tier", None,  # type: ignore[arg-type]
          check_as="identifying the node-local directory")
    got = gather_each(_Peer(["listing step_2", None, 7]), "listing /n0/tier/step_2",  # type: ignore[arg-type]
                      lambda: 5, check_as="listing step_2")
    assert got == [5, 7]
    with pytest.raises(DistributedError, match="rank 1 failed during listing /n0/tier/step_2"):
        gather_each(_Peer(["listing step_2", "OSError: gone", None]),  # type: ignore[arg-type]
                    "listing /n0/tier/step_2", lambda: 5, check_as="listing step_2")
    with pytest.raises(DistributedError,
                       match="rank 0 was in 'listing step_2', rank 1 in 'listing step_3'"):
        gather_each(_Peer(["listing step_3", None, 7]), "listing /n0/tier/step_2",  # type: ignore[arg-type]
                    lambda: 5, check_as="listing step_2")
