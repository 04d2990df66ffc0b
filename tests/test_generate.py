"""`loca generate` where a user can ask for the impossible: more tokens than the context holds, an
empty prompt, a model whose logits turn NaN."""

import pytest
import torch
from tiny import save_tiny_model, tiny_model, tiny_tokenizer

from loca.cli.generate_command import cap_new_tokens, nan_cause
from loca.cli.main import main

pytestmark = pytest.mark.integration

PROMPT = "Review: a charming journey"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny model (a 256-token context) and a copy with one NaN weight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("generate")
    good = save_tiny_model(root / "model")
    tokenizer = AutoTokenizer.from_pretrained(good)
    for name, edit in (
        ("nan", lambda w: w.__setitem__((0, 0), float("nan"))),
        ("huge", lambda w: w.mul_(1e30)),
    ):
        model = AutoModelForCausalLM.from_pretrained(good)
        with torch.no_grad():
            edit(model.model.layers[0].mlp.down_proj.weight)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root, len(tokenizer(PROMPT).input_ids)


def generate(root, model: str, *flags: str) -> list[str]:
    return ["generate", "--model", str(root / model), "--device", "cpu", *flags]


def test_max_new_tokens_is_capped_at_the_context(models, capsys):
    root, prompt_tokens = models
    assert main(generate(root, "model", "--prompt", PROMPT, "--max-new-tokens", "100000")) == 0
    out, err = capsys.readouterr()
    room = 256 - prompt_tokens
    assert f"--max-new-tokens 100000 capped at {room}: the model's context is 256 tokens" in err
    assert out.startswith("[frozen] ") and len(out.split()) - 1 <= room  # one word per token
    assert cap_new_tokens(32, prompt_tokens, 256) == 32 and cap_new_tokens(32, 10, None) == 32
    with pytest.raises(ValueError, match="the prompt takes 256 tokens, the model's whole context of 256"):
        cap_new_tokens(5, 256, 256)


def test_an_empty_prompt_is_refused(models, capsys):
    root, _ = models
    assert main(generate(root, "model", "--prompt", "")) == 2
    err = capsys.readouterr().err
    assert "error: --prompt is empty: give the text to continue" in err and "Traceback" not in err


def test_nan_logits_are_an_error_naming_the_cause(models, capsys):
    root, _ = models
    assert main(generate(root, "nan", "--prompt", PROMPT, "--max-new-tokens", "4")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no empty completion printed
    assert (
        "error: the frozen model: the logits of generated token 1 are NaN; its weight "
        "model.layers.0.mlp.down_proj.weight holds NaN/Inf: the checkpoint is damaged" in captured.err
    )
    # finite weights: the likely cause is an overflow of the dtype (or of the adapter's activations)
    finite = tiny_model(tiny_tokenizer(), dtype=torch.bfloat16)
    assert nan_cause(finite, "frozen").endswith(
        "the torch.bfloat16 activations overflow: try --dtype float32"
    )
    assert "the adapter drives the torch.bfloat16 activations to overflow: try --dtype float32" in nan_cause(
        finite, "loca"
    )
    wide = tiny_model(tiny_tokenizer())  # float32 already: no advice to load it in float32
    assert nan_cause(wide, "frozen").endswith("its torch.float32 activations overflow: check the checkpoint")
    assert nan_cause(wide, "loca").endswith("to overflow: generate without --adapter to compare")
