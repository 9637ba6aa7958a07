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


@pytest.mark.parametrize("to,name", [("statestream", "out"), ("safetensors", "o.safetensors"),
                                     ("torch", "o.pt"), ("dcp", "dcp")])
def test_items_naming_the_alias_before_its_array(tmp_path, tied, to, name):
    """The tie's second name listed first: its alias became the array leaf and the real
    leaf stayed one too (two leaves of one array: verify said DAMAGED, load refused)."""
    src, sd = tied
    out = ss.convert(src, tmp_path / name, to=to,
                     items=["model/head.weight", "model/emb.weight"])
    assert ss.verify(out).ok
    got = ss.load(out)
    assert list(got) == ["head.weight", "emb.weight"]
    for k in got:
        assert torch.equal(torch.as_tensor(got[k]), sd[k]), k


def test_torch_save_file_with_tied_weights_reads_the_tie(tmp_path):
    """A Hugging Face pytorch_model.bin (torch.save of a state_dict whose lm_head.weight
    and transformer.wte.weight are one parameter) reads as one array under both names,
    as statestream's own save stores it: loaded tied, converted and exported once."""
    from safetensors import safe_open

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    src = tmp_path / "pytorch_model.bin"
    own = tmp_path / "own"
    ss.save(own, sd)
    assert ss.metadata(src).num_arrays == ss.metadata(own).num_arrays == len(sd) - 1
    got = ss.load(src)
    _same(got, sd)
    assert got["lm_head.weight"] is got["transformer.wte.weight"]
    fresh = transformers.GPT2LMHeadModel(cfg).eval()
    ss.load(src, target=fresh)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    x = torch.arange(6).reshape(1, 6)
    assert torch.equal(fresh(x).logits, model(x).logits)
    out = ss.convert(src, tmp_path / "ck")
    assert ss.metadata(out).num_arrays == len(sd) - 1
    conv = ss.load(out)
    assert conv["lm_head.weight"] is conv["transformer.wte.weight"]
    st = ss.convert(src, tmp_path / "model.safetensors")
    with safe_open(st, "np") as f:
        assert "lm_head.weight" not in f.keys() and "transformer.wte.weight" in f.keys()
    back = ss.load(st)
    assert back["lm_head.weight"] is back["transformer.wte.weight"]
    # only the tied name selected: it is that array
    one = ss.load(src, items=["lm_head.weight"])
    assert torch.equal(torch.as_tensor(one["lm_head.weight"]), sd["lm_head.weight"])


def test_torch_save_views_of_one_storage_are_aliases_only_when_the_same_view(tmp_path):
    """Tensors over one storage are one array only when they are the same view (offset,
    shape, strides, dtype), as statestream's own save decides; other views of the
    storage read as their own arrays (bytes read from the one stored copy)."""
    base = torch.arange(12.0)
    state = {"a": base, "same": base.detach(), "part": base[4:8], "shaped": base.view(3, 4),
             "e1": torch.zeros(0), "e2": torch.zeros(0)}
    torch.save(state, tmp_path / "v.pt")
    ss.save(tmp_path / "own", state)
    md = ss.metadata(tmp_path / "v.pt")
    assert md.num_arrays == ss.metadata(tmp_path / "own").num_arrays == 5
    got = ss.load(tmp_path / "v.pt")
    assert got["a"] is got["same"] and got["part"] is not got["a"]
    _same(got, state)
