"""Fuzzing the formats of others: byte-damaged safetensors files, torch.save files, DCP
directories, Hugging Face sharded directories and Orbax checkpoints (one directory per
array, and OCDBT) against load, metadata, verify and the CLI. As for statestream's own
format (test_fuzz_checkpoints.py), every example must end in a result or a
CheckpointError, within a timeout and a memory cap. The default run is bounded;
``STATESTREAM_FUZZ_FOREIGN_EXAMPLES=500`` runs a longer campaign."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from hypothesis import HealthCheck, given, settings

from statestream.testing.fuzz import (
    apply_bytes_to_copy,
    byte_mutations,
    failures,
    failures_of_copy,
    run_targets,
)

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

EXAMPLES = int(os.environ.get("STATESTREAM_FUZZ_FOREIGN_EXAMPLES", "40"))
TIMEOUT_S = float(os.environ.get("STATESTREAM_FUZZ_TIMEOUT_S", "60"))
FORMATS = ["safetensors", "torch", "dcp", "hf", "orbax", "orbax-ocdbt"]
#: JAX and tensorstore reserve gigabytes of address space (thread stacks, arenas):
#: under the 1 GiB cap of the other formats they cannot start their threads
MEMORY_BYTES = {"orbax": 8 << 30, "orbax-ocdbt": 8 << 30}

pytestmark = pytest.mark.timeout(max(600, int(EXAMPLES * TIMEOUT_S)))


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("foreign")
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(16, 8, generator=g), "b": torch.arange(5),
             "h": torch.randn(3, generator=g).half()}
    st_torch.save_file(state, root / "m.safetensors")
    torch.save({"params": state, "step": 3, "lr": [0.1, 0.2]}, root / "m.pt")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"params": state, "step": 4}, checkpoint_id=str(root / "dcp"))
    hf = root / "hf"
    hf.mkdir()
    st_torch.save_file({"w": state["w"]}, hf / "model-00001-of-00002.safetensors")
    st_torch.save_file({"b": state["b"], "h": state["h"]}, hf / "model-00002-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "h": "model-00002-of-00002.safetensors"}}))
    out = {"safetensors": str(root / "m.safetensors"), "torch": str(root / "m.pt"),
           "dcp": str(root / "dcp"), "hf": str(hf)}
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return out
    np_state = {"params": {k: v.numpy() for k, v in state.items()}, "step": 3, "lr": 0.1}
    for name, ocdbt in (("orbax", False), ("orbax-ocdbt", True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt))
            ck.save(root / name, np_state)
            ck.close()
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_undamaged_foreign_checkpoints_pass_every_target(bases: dict[str, str],
                                                          fmt: str) -> None:
    if fmt not in bases:
        pytest.skip("orbax-checkpoint is not installed")
    res = run_targets(bases[fmt], timeout_s=TIMEOUT_S,
                      memory_bytes=MEMORY_BYTES.get(fmt, 1 << 30))
    assert not failures(res), res
    assert res["load"] == "ok" and res["metadata"] == "ok", res


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_foreign_checkpoints_fail_cleanly(bases: dict[str, str], fmt: str) -> None:
    if fmt not in bases:
        pytest.skip("orbax-checkpoint is not installed")
    # an Orbax example imports orbax, JAX and tensorstore in its child (~1 s): half as many
    @settings(max_examples=EXAMPLES // 2 if fmt in MEMORY_BYTES else EXAMPLES, deadline=None,
              database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(muts=byte_mutations())
    def check(muts: list[tuple[object, ...]]) -> None:
        bad = failures_of_copy(apply_bytes_to_copy(bases[fmt], muts), timeout_s=TIMEOUT_S,
                               memory_bytes=MEMORY_BYTES.get(fmt, 1 << 30))
        assert not bad, bad

    check()
