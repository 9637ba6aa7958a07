"""What the pages' code blocks assume (SETUPS, run before a block) and what the text
next to a block claims (CHECKS, run after it). Names are used in the markdown's
``<!-- doc-test: setup=...; check=... -->`` comments (see _doc_blocks.py)."""

from __future__ import annotations

SETUPS: dict[str, str] = {}
CHECKS: dict[str, str] = {}

# ----------------------------------------------------------------------------- one process
SETUPS["torch-model"] = """
import numpy as np
import torch
import statestream as ss

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)

torch.manual_seed(0)
model = Net()
opt = optim = optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
model(torch.randn(3, 4)).sum().backward()
opt.step()
sched.step()
"""

SETUPS["torch-state"] = SETUPS["torch-model"] + """
path = "ckpt/run"
state = {"model": model, "optim": optim, "step": 0}
start, steps, step, loss = 0, 3, 500, 0.5
"""

SETUPS["torch-pickle-state"] = SETUPS["torch-state"] + """
import types
state["extra"] = {"tokenizer": types.SimpleNamespace(vocab=["a", "b"])}
target = {"model": model}
"""

SETUPS["numpy-state"] = """
import numpy as np
import statestream as ss
path = "ckpt/run"
state = {"params": {"w": np.linspace(0, 1, 4096, dtype=np.float32)},
         "opt": {"mu": np.zeros(4096, np.float32)}, "step": 3}
step, loss = 500, 0.5
"""

# ----------------------------------------------------------------------------- processes
SETUPS["torch-dist"] = """
import os
import torch
import torch.distributed as dist
import statestream as ss

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
path, step = "ckpt/step-100", 100
"""

SETUPS["fsdp"] = SETUPS["torch-dist"] + """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

torch.manual_seed(0)
fsdp_model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
fully_shard(fsdp_model, mesh=init_device_mesh("cpu", (world_size,)))
optim = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-2)
fsdp_model(torch.randn(2, 16)).sum().backward()
optim.step()
"""

SETUPS["torch-dist-state"] = SETUPS["torch-dist"] + """
state = {"model": {"w": torch.arange(8.0) + rank}, "step": 3}
like = {"model": {"w": torch.zeros(8)}, "step": 0}
"""

SETUPS["jax-procs"] = """
import os
import numpy as np
import jax

host, port = "127.0.0.1", int(os.environ["MASTER_PORT"])
nprocs, proc = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
full = np.arange(32, dtype=np.float32).reshape(8, 4)
path = "ckpt/jax"
"""

# ----------------------------------------------------------------------------- checks
CHECKS["readme-load"] = """
assert isinstance(state["model"]["fc.weight"], np.ndarray) and state["step"] == 100
assert out["model"] is model and out["optim"] is opt and out["step"] == 100
assert isinstance(out["rng"], torch.Tensor)
assert set(params) == {"model"} and set(params["model"]) == {"fc.weight", "fc.bias"}
assert set(w) == {"model"} and list(w["model"]) == ["fc.weight"]
assert meta.tree["model"]["fc.weight"].shape == (2, 4)
"""

CHECKS["readme-options"] = """
back = ss.load(path, items=["extra"], allow_pickle=["extra/tokenizer"])
assert back["extra"]["tokenizer"].vocab == ["a", "b"]
try:
    ss.load(path, items=["extra"])
except ss.PickleNotAllowedError as e:
    assert "extra/tokenizer" in str(e)
else:
    raise AssertionError("a pickle leaf loaded without allow_pickle")
"""

CHECKS["readme-compression"] = """
a, b = ss.metadata("ckpt/a"), ss.metadata("ckpt/b")
assert a.format_version == 2 and a.tree["opt"]["mu"].codec == "zstd"
assert b.tree["params"]["w"].codec is None and b.tree["opt"]["mu"].codec == "zstd"
assert b.tree["opt"]["mu"].stored_bytes < b.tree["opt"]["mu"].nbytes
"""

CHECKS["readme-incremental"] = """
m = ss.metadata("ckpt/step-200")
assert m.bases == ["step-100"] and m.referenced_bytes == m.total_bytes, m
"""

SETUPS["interop-files"] = SETUPS["torch-model"] + """
import json, os
from safetensors.torch import save_file

sd0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
save_file(sd0, "model.safetensors")
os.makedirs("hf-model")
save_file({"fc.weight": sd0["fc.weight"]}, "hf-model/model-00001-of-00002.safetensors")
save_file({"fc.bias": sd0["fc.bias"]}, "hf-model/model-00002-of-00002.safetensors")
with open("hf-model/model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": {"fc.weight": "model-00001-of-00002.safetensors",
                                              "fc.bias": "model-00002-of-00002.safetensors"}}, f)
torch.save(sd0, "ckpt.pt")
ss.save("ckpt/step-100", {"model": model, "optim": opt, "step": 100})
"""

CHECKS["interop"] = """
assert isinstance(sd["fc.weight"], torch.Tensor) and torch.equal(sd["fc.weight"], sd0["fc.weight"])
assert ss.metadata("ckpt.pt").tree["fc.weight"].shape == (2, 4)
assert ss.metadata("ckpt/imported").format == "statestream"
assert ss.metadata("dcp-out").format == "dcp"
"""
CHECKS["interop"] += """
assert set(ss.load("export.safetensors")) == {"fc.weight", "fc.bias"}
"""

CHECKS["async"] = """
h.result()
assert ss.verify("ckpt/step-100").ok and ss.verify("ckpt/step-200").ok
"""

SETUPS["manager-metrics"] = SETUPS["numpy-state"] + """
mgr = ss.CheckpointManager("ckpt", async_save=False)
for s, v in [(100, 0.9), (200, 0.4), (300, 0.6)]:
    mgr.save(s, state, metrics={"val_loss": v})
"""

CHECKS["manager-best"] = """
assert best == 200 and state["step"] == 3
"""

CHECKS["manager-first"] = """
assert best == 500 and state["step"] == 3
"""

CHECKS["local-tier"] = """
assert mgr.persisted_steps() == [500] and mgr.steps() == [500]
mgr.close()
"""

SETUPS["torch-dist-saved"] = SETUPS["torch-dist-state"] + """
ss.save(path, state)
"""

CHECKS["single-process-load"] = """
if rank == 0:
    assert set(full) == {"model", "step"} and set(w) == {"model"}
    np = __import__("numpy")
    assert isinstance(full["model"]["w"], np.ndarray)
"""

SETUPS["jax-path"] = """
path = "ckpt/jax"
"""

CHECKS["jax-reshard"] = """
assert type(restored["opt_state"]).__name__ == "AdamState" and restored["step"] == 100
assert restored["params"]["w"].sharding.mesh.devices.shape == (2, 2)
np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.arange(64.0).reshape(8, 8))
np.testing.assert_array_equal(np.asarray(p["params"]["b"]), np.ones(8))
"""

CHECKS["jax-procs"] = """
np.testing.assert_array_equal(np.asarray(jax.experimental.multihost_utils.process_allgather(
    out["params"]["w"], tiled=True)), full)
assert out["step"] == 7
"""

CHECKS["fsdp-restore"] = """
assert step == 100
"""

CHECKS["s3-env"] = """
import numpy as np
import statestream as ss
ss.save("s3://my-bucket/runs/exp1/step-1000", {"w": np.arange(4)})
assert ss.load("s3://my-bucket/runs/exp1/step-1000")["w"].tolist() == [0, 1, 2, 3]
"""

CHECKS["s3-options"] = """
assert ss.verify("s3://my-bucket/runs/exp1/step-1000").ok
"""

CHECKS["policies"] = """
with ss.CheckpointManager("ckpt") as again:
    assert again.steps() == [0, 8, 12], again.steps()
"""
