"""Residual adapters: identities, hooks, seeds, state, save/load and the checkpoint guard."""

import json

import pytest
import torch
from tiny import save_tiny_model, sequences, tiny_model, tiny_parts, tiny_tokenizer

from loca.data.batching import make_batches
from loca.method.adapters import ResidualAdapters, adapter_a
from loca.method.artefacts import BASE_KEYS, CheckpointMismatchError, source_record
from loca.models.parts import find_parts

pytestmark = pytest.mark.unit


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def test_b_zero_is_exactly_frozen_and_detach_is_bit_identical():
    model, parts = tiny_parts()
    batch = make_batches(sequences(6), pad_id=0)[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = logits(model, batch)
    adapters = ResidualAdapters(parts, rank=4).attach()
    assert torch.equal(logits(model, batch), before)
    adapters.B[1] = torch.randn_like(adapters.B[1])
    assert not torch.allclose(logits(model, batch), before)
    adapters.detach()
    assert torch.equal(logits(model, batch), before)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(b._forward_hooks for b in parts.blocks)


def test_correction_is_b_a_of_the_block_input():
    model, parts = tiny_parts(layers=2)
    batch = make_batches(sequences(3), pad_id=0)[0]
    captured = {}
    h = parts.blocks[0].register_forward_hook(lambda m, a, o: captured.setdefault("out", o))
    parts.blocks[0].register_forward_pre_hook(lambda m, a: captured.setdefault("in", a[0]))
    adapters = ResidualAdapters(parts, rank=4).attach()
    adapters.B[0] = torch.randn_like(adapters.B[0])
    seen = {}
    parts.blocks[1].register_forward_pre_hook(lambda m, a: seen.setdefault("h1", a[0]))
    logits(model, batch)
    h.remove()
    want = captured["out"] + (captured["in"].float() @ adapters.A[0].T @ adapters.B[0].T).double()
    torch.testing.assert_close(seen["h1"], want)


def test_a_is_rebuilt_from_seed_and_layer():
    a = adapter_a(7, 3, 8, 64)
    assert torch.equal(a, adapter_a(7, 3, 8, 64))
    assert not torch.equal(a, adapter_a(7, 4, 8, 64))
    assert not torch.equal(a, adapter_a(8, 3, 8, 64))
    assert a.std().item() == pytest.approx(64**-0.5, rel=0.15)


def test_fp32_adapters_on_bf16_backbone():
    model, parts = tiny_parts(dtype=torch.bfloat16)
    adapters = ResidualAdapters(parts, rank=4).attach()
    assert all(x.dtype == torch.float32 for x in adapters.A + adapters.B)
    adapters.B[0] = torch.randn_like(adapters.B[0])
    out = logits(model, make_batches(sequences(2), pad_id=0)[0])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_save_load_roundtrip_and_wrong_checkpoint(tmp_path):
    model, parts = tiny_parts()
    adapters = ResidualAdapters(parts, rank=4, seed=5)
    adapters.set_b([torch.randn_like(b) for b in adapters.B])
    adapters.save_pretrained(tmp_path / "ad")
    loaded = ResidualAdapters.from_pretrained(parts, tmp_path / "ad")
    assert loaded.seed == 5 and loaded.rank == 4
    assert all(torch.equal(x, y) for x, y in zip(loaded.B, adapters.B, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(loaded.A, adapters.A, strict=True))
    _, other = tiny_parts(seed=1)
    with pytest.raises(CheckpointMismatchError, match="another checkpoint"):
        ResidualAdapters.from_pretrained(other, tmp_path / "ad")


def test_set_b_rejects_wrong_shapes():
    _, parts = tiny_parts()
    adapters = ResidualAdapters(parts, rank=4)
    with pytest.raises(ValueError, match="shape"):
        adapters.set_b([torch.zeros(3, 3)] * parts.num_blocks)


def test_in_place_edits_of_b_take_effect():
    """The zero-B fast path is cached per tensor version, so in-place edits are not missed."""
    model, parts = tiny_parts()
    batch = make_batches(sequences(3), pad_id=0)[0]
    adapters = ResidualAdapters(parts, rank=4).attach()
    frozen = logits(model, batch)
    adapters.B[0].add_(0.5)
    edited = logits(model, batch)
    assert not torch.allclose(edited, frozen)
    adapters.B[0].zero_()
    assert torch.equal(logits(model, batch), frozen)


def test_zero_b_is_skipped_without_testing_values_in_the_forward(monkeypatch):
    """B known zero (after reset/set_b) skips the correction; an in-place edit makes it active
    without a value test (no device sync per forward), and an edit back to zero stays exact."""
    model, parts = tiny_parts()
    batch = make_batches(sequences(4), pad_id=0)[0]
    before = logits(model, batch)
    adapters = ResidualAdapters(parts, rank=4).attach()
    adapters.reset()
    calls = []
    real_any = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda self, *a, **k: calls.append(1) or real_any(self, *a, **k))
    assert torch.equal(logits(model, batch), before)
    adapters.B[0].add_(1.0)
    changed = logits(model, batch)
    adapters.B[0].sub_(1.0)  # back to zero, in place: the correction runs and adds exact zeros
    assert torch.equal(logits(model, batch), before) and not torch.equal(changed, before)
    assert calls == []
    adapters.set_b(adapters.get_b())
    assert adapters._b_state(0, torch.float32)[0] is False


def test_adapter_files_are_locas_own_and_legacy_folders_still_load(tmp_path):
    import os

    _, parts = tiny_parts()
    ad = ResidualAdapters(parts, rank=4, seed=2)
    ad.set_b([torch.randn_like(b) for b in ad.B])
    ad.save_pretrained(tmp_path / "ad", extra={"task": "sst2"})
    names = sorted(p.name for p in (tmp_path / "ad").iterdir())
    assert names == ["README.md", "loca_adapter.json", "loca_adapter.safetensors"]
    assert "Not a PEFT adapter" in (tmp_path / "ad" / "README.md").read_text()
    assert json.loads((tmp_path / "ad" / "loca_adapter.json").read_text())["format"] == "loca-adapter"
    from peft import PeftConfig  # PEFT does not mistake the folder for one of its own

    with pytest.raises(ValueError):
        PeftConfig.from_pretrained(str(tmp_path / "ad"))
    # a folder written with the earlier (PEFT-like) names loads the same adapters
    os.rename(tmp_path / "ad" / "loca_adapter.json", tmp_path / "ad" / "adapter_config.json")
    os.rename(tmp_path / "ad" / "loca_adapter.safetensors", tmp_path / "ad" / "adapter_model.safetensors")
    old = ResidualAdapters.from_pretrained(parts, tmp_path / "ad")
    assert all(torch.equal(x, y) for x, y in zip(old.get_b(), ad.get_b(), strict=True))
    ad.save_pretrained(tmp_path / "ad")  # a legacy folder is loca's: replaced, not refused
    assert (tmp_path / "ad" / "loca_adapter.json").is_file()


def test_disable_adapter_runs_the_frozen_model_and_generation_matches_uncached():
    from loca.eval.evaluation import completion_ce

    model, parts = tiny_parts()
    batches = make_batches(sequences(8), pad_id=0, batch_size=8)
    frozen = completion_ce(parts, batches).mean
    ad = ResidualAdapters(parts, rank=4, seed=2).attach()
    gen = torch.Generator().manual_seed(0)
    ad.set_b([0.5 * torch.randn(b.shape, generator=gen, dtype=b.dtype) for b in ad.B])
    adapted = completion_ce(parts, batches).mean
    with ad.disable_adapter():
        assert completion_ce(parts, batches).mean == frozen
    assert completion_ce(parts, batches).mean == adapted != frozen
    prompt = torch.tensor([[3, 7, 9, 4]])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kw)
    uncached = model.generate(prompt, use_cache=False, **kw)
    assert torch.equal(cached, uncached)
    with ad.disable_adapter():
        assert not torch.equal(model.generate(prompt, use_cache=True, **kw), cached)
    ad.detach()


@pytest.mark.parametrize("budget_mb", [64.0, 1e-9])  # all blocks encoded at the end / each at once
def test_recorder_codes_and_norms_are_those_of_the_gathered_rows(budget_mb):
    from loca.method.stage2 import Recorder

    gen = torch.Generator().manual_seed(0)
    batch, width, d, r = 3, 5, 8, 2
    pos_b, pos_t = torch.tensor([0, 0, 2, 1]), torch.tensor([1, 4, 0, 3])
    a = torch.randn(3, r, d, generator=gen)
    cpu = torch.device("cpu")
    rec = Recorder(pos_b, pos_t, width, {cpu: ([1, 2, 4], a)}, budget_mb=budget_mb)
    assert rec.wants(2) and not rec.wants(0)
    inputs = {l: torch.randn(batch, width, d, generator=gen, dtype=torch.float64) for l in (1, 2, 4)}
    for l in (1, 2, 4):
        rec.record(l, inputs[l])
    p, sumsq = rec.codes_and_norms(cpu)
    rows = torch.stack([inputs[l][pos_b, pos_t] for l in (1, 2, 4)])
    assert p.dtype == sumsq.dtype == torch.float32  # statistics' inputs are float32
    torch.testing.assert_close(p.double(), rows @ a.double().mT, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sumsq.double(), rows.pow(2).sum(dim=(1, 2)), rtol=1e-5, atol=1e-6)
    out_of_order = Recorder(pos_b, pos_t, width, {cpu: ([1, 2, 4], a)})
    out_of_order.record(2, inputs[2])
    out_of_order.record(1, inputs[1])
    with pytest.raises(RuntimeError, match="forward order"):
        out_of_order.codes_and_norms(cpu)


def test_load_adapted_loads_the_base_model_the_adapter_records(tmp_path, monkeypatch):
    """``loca.load_adapted(DIR)``: the recorded base model (a relative path as named, found from
    another working directory through its absolute path), with the adapters attached; another
    ``model=`` is refused naming the one it was fitted on."""
    import loca
    from loca.method.adapters import base_model_record

    save_tiny_model(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    model, tokenizer = loca.load_model("base", device="cpu")
    ad = ResidualAdapters(find_parts(model), rank=4)
    ad.set_b([torch.randn_like(b) for b in ad.B])
    ad.save_pretrained(tmp_path / "ad", extra=source_record("base", BASE_KEYS))
    assert base_model_record(model)["base_model_path"] == str(tmp_path / "base")
    monkeypatch.chdir(tmp_path / "ad")  # "base" does not exist from here
    loaded, tok, adapters = loca.load_adapted(tmp_path / "ad", device="cpu")
    assert adapters.attached and len(tok) == len(tokenizer)
    assert all(torch.equal(x, y) for x, y in zip(adapters.get_b(), ad.get_b(), strict=True))
    ids = torch.tensor([[3, 7, 9, 4]])
    with torch.no_grad(), ad:  # the same adapters on the model loaded by hand
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    other = tmp_path / "other"
    tiny_model(tiny_tokenizer(), seed=1).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    with pytest.raises(CheckpointMismatchError, match="fitted on base"):
        loca.load_adapted(tmp_path / "ad", model=str(other), device="cpu")
    cfg = json.loads((tmp_path / "ad" / "loca_adapter.json").read_text())
    cfg["base_model"] = None
    (tmp_path / "ad" / "loca_adapter.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not record its base model"):
        loca.load_adapted(tmp_path / "ad", device="cpu")


def test_an_adapter_of_an_alias_records_and_loads_the_alias(tmp_path, monkeypatch):
    """A model loaded from a built-in alias's folder is recorded by the alias (not the cache
    path), and ``load_adapted`` asks ``load_model`` for the alias."""
    import loca
    import loca.method.adapters as adapters_module
    from loca.models.zoo import alias_dir

    monkeypatch.setenv("LOCA_HOME", str(tmp_path / "home"))
    folder = save_tiny_model(alias_dir("smollm2-135m-instruct"))
    model, tokenizer = loca.load_model(str(folder), device="cpu")
    ad = ResidualAdapters(find_parts(model), rank=4)
    assert ad.config()["base_model"] == "smollm2-135m-instruct" and ad.config()["base_model_path"] is None
    ad.save_pretrained(tmp_path / "ad")
    asked = []

    def fake_load_model(name, **kwargs):
        asked.append((name, kwargs))
        return model, tokenizer

    monkeypatch.setattr(adapters_module, "load_model", fake_load_model)
    _, _, attached = loca.load_adapted(tmp_path / "ad", device="cpu")
    assert asked == [("smollm2-135m-instruct", {"revision": None, "device": "cpu"})] and attached.attached
    attached.unload()
    cfg = json.loads((tmp_path / "ad" / "loca_adapter.json").read_text())  # a hub id at a commit
    cfg.update(base_model="org/model", base_model_revision="0123abc")
    (tmp_path / "ad" / "loca_adapter.json").write_text(json.dumps(cfg))
    loca.load_adapted(tmp_path / "ad", device="cpu")[2].unload()
    assert asked[-1] == ("org/model", {"revision": "0123abc", "device": "cpu"})
