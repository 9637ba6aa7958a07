"""manager._uploads: which process persists which data file of a node-local step
(the multi-process cases are in tests/distributed/test_tier_peers.py)."""

from __future__ import annotations

from statestream.engine import NodeGroups
from statestream.manager._uploads import _assign

WANTED = {"data/r0-0.bin": 10, "data/r1-0.bin": 20, "data/r2-0.bin": 30, "data/r3-0.bin": 40}


def test_each_file_goes_to_its_writer_while_its_node_holds_it() -> None:
    groups = NodeGroups(["a", "a", "b", "b"], 0)
    held = [{"data/r0-0.bin": 10, "data/r1-0.bin": 20}, None,
            {"data/r2-0.bin": 30, "data/r3-0.bin": 40}, None]
    owners, lost = _assign(WANTED, held, groups)
    assert owners == {f"data/r{r}-0.bin": r for r in range(4)} and lost == []


def test_files_of_ranks_now_elsewhere_go_to_the_nodes_that_hold_them() -> None:
    groups = NodeGroups(["a", "a", "b", "b"], 0)
    # restarted with the nodes swapped: ranks 0, 1 on the disk ranks 2, 3 wrote to
    held = [{"data/r2-0.bin": 30, "data/r3-0.bin": 40}, None,
            {"data/r0-0.bin": 10, "data/r1-0.bin": 20, "data/r3-0.bin": 41}, None]
    owners, lost = _assign(WANTED, held, groups)
    # spread over each holding node's processes; r3 at another size counts only on a
    assert owners == {"data/r0-0.bin": 2, "data/r1-0.bin": 3, "data/r2-0.bin": 0,
                      "data/r3-0.bin": 1}
    assert lost == []


def test_a_file_no_node_holds_is_lost() -> None:
    owners, lost = _assign(WANTED, [{"data/r0-0.bin": 10, "data/r1-0.bin": 20}],
                           NodeGroups(["a"], 0))
    assert owners == {"data/r0-0.bin": 0, "data/r1-0.bin": 0}
    assert lost == ["data/r2-0.bin", "data/r3-0.bin"]
