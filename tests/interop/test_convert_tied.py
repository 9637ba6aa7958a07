"""ss.convert with tied weights (aliases): stored once where the format can, never corrupt."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import statestream as ss  # noqa: E402


@pytest.fixture
def tied(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    sd = {"emb.weight": emb.weight.detach(), "x": torch.arange(3.0),
          "head.weight": head.weight.detach()}
    src = tmp_path / "src"
    ss.save(src, {"model": sd, "step": 1})
    assert ss.metadata(src).num_arrays == 2  # the tie is stored once
    return src, sd


def _same(got, sd):
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(torch.as_tensor(got[k]), v), k


def test_to_statestream_keeps_the_alias(tmp_path, tied):
    src, sd = tied
    out = ss.convert(src, tmp_path / "out", items=["model"])
    assert ss.metadata(out).num_arrays == 2
    got = ss.load(out)
    _same(got, sd)
    assert got["emb.weight"] is got["head.weight"]


@pytest.mark.parametrize("sharded", [False, True])
def test_to_safetensors_writes_the_tensor_once(tmp_path, tied, sharded):
    from safetensors import safe_open

    src, sd = tied
    if sharded:
        out = ss.convert(src, tmp_path / "hf", to="safetensors", items=["model"],
                         max_shard_bytes=100)
        index = (tmp_path / "hf" / "model.safetensors.index.json").read_text()
        assert '"emb.weight"' in index and '"head.weight"' not in index
    else:
        out = ss.convert(src, tmp_path / "o.safetensors", items=["model"])
        with safe_open(out, "np") as f:
            assert sorted(f.keys()) == ["emb.weight", "x"]  # the first name, as HF does
    got = ss.load(out)
    _same(got, sd)
    assert got["emb.weight"] is got["head.weight"]  # the tree records the tie


def test_to_torch_keeps_the_tie_as_torch_save_does(tmp_path, tied):
    src, sd = tied
    out = ss.convert(src, tmp_path / "o.pt", items=["model"])
    got = torch.load(out, weights_only=True)
    _same(got, sd)
    assert got["emb.weight"] is got["head.weight"]  # one tensor, stored once
    import zipfile

    with zipfile.ZipFile(out) as z:
        assert sum("/data/" in n for n in z.namelist()) == 2  # emb (= head) and x
    expected = tmp_path / "ref.pt"
    torch.save(sd, expected)
    ref = torch.load(expected, weights_only=True)
    # torch.save itself keeps the tie as one storage
    assert ref["emb.weight"].data_ptr() == ref["head.weight"].data_ptr()


@pytest.mark.parametrize("to,name", [("dcp", "dcp"), ("orbax", "orbax")])
def test_formats_without_aliases_write_a_copy(tmp_path, tied, to, name):
    """DCP's and Orbax's own savers write a tied tensor under each name; so do we."""
    if to == "orbax":
        pytest.importorskip("orbax.checkpoint")
    src, sd = tied
    out = ss.convert(src, tmp_path / name, to=to, items=["model"])
    _same(ss.load(out), sd)


def test_items_selecting_only_the_alias(tmp_path, tied):
    src, sd = tied
    out = ss.convert(src, tmp_path / "one", items=["model/head.weight"])
    got = ss.load(out)
    assert list(got) == ["head.weight"]
    assert torch.equal(torch.as_tensor(got["head.weight"]), sd["head.weight"])
    out = ss.convert(src, tmp_path / "two", items=["model/x", "model/head.weight"])
    got = ss.load(out)
    assert sorted(got) == ["head.weight", "x"]
    assert torch.equal(torch.as_tensor(got["head.weight"]), sd["head.weight"])
