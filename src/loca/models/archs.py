"""Published architectures without their weights, for time and memory runs: ``--model
arch:qwen2.5-7b`` is the Qwen2.5-7B config with random weights (``--random-init`` implied) and the
SmolLM2 alias's tokenizer (its token ids are valid in every one of these vocabularies; text
lengths are SmolLM2's). Nothing is downloaded but the SmolLM2 alias (once).

    loca bench --model arch:qwen2.5-7b --dtype bfloat16 --task boolq ...
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .zoo import ensure_alias, loca_home

QWEN = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=32768,
    attention_dropout=0.0,
    use_sliding_window=False,
)
LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_act="silu",
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    attention_bias=False,
    mlp_bias=False,
)


def shape(
    base: dict, d: int, ff: int, layers: int, heads: int, kv: int, vocab: int, tied: bool, **kw
) -> dict:
    return dict(
        base,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        **kw,
    )


# published shapes (the models' config.json files)
ARCHS = {
    "qwen2.5-0.5b": shape(QWEN, 896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": shape(QWEN, 1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": shape(QWEN, 2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": shape(QWEN, 3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": shape(QWEN, 5120, 13824, 48, 40, 8, 152064, False),
    "smollm2-135m": shape(LLAMA, 576, 1536, 30, 9, 3, 49152, True, rope_theta=100000),
    "smollm2-360m": shape(LLAMA, 960, 2560, 32, 15, 5, 49152, True, rope_theta=100000),
    "smollm2-1.7b": shape(LLAMA, 2048, 8192, 24, 32, 32, 49152, True, rope_theta=130000),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_arch_folder(name: str, out: Path, tokenizer_from: Path | None = None) -> Path:
    """``out`` with ``config.json`` of architecture ``name`` and a tokenizer (default: SmolLM2's)."""
    source = tokenizer_from or ensure_alias("smollm2-135m-instruct")
    out.mkdir(parents=True, exist_ok=True)
    config = {
        **ARCHS[name],
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "bfloat16",
        "loca_arch_preset": name,
        "tokenizer": str(source),
    }
    for f in TOKENIZER_FILES:
        if (Path(source) / f).is_file():
            shutil.copy(Path(source) / f, out / f)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def arch_folder(model: str) -> Path:
    """The folder for ``arch:NAME`` under ``$LOCA_HOME/archs`` (written once)."""
    name = model.removeprefix("arch:")
    if name not in ARCHS:
        raise ValueError(f"unknown architecture {name!r}; choose from {', '.join(ARCHS)}")
    out = loca_home() / "archs" / name
    if not (out / "config.json").is_file():
        write_arch_folder(name, out)
    return out
