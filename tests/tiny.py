"""The tests' tiny models, built offline: one builder (:func:`tiny_lm`, any supported family and
size) and its helpers: a word-level tokenizer with a matching model, the float64 model of the
engine tests with its parts and a learnable token task, and saved model folders and task files
for the command-line tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from loca.data.batching import Encoded
from loca.models.parts import find_parts

VOCAB = 101  # the builder's default vocabulary
SEQUENCE_VOCAB = 97  # the vocabulary of :func:`sequences` and :func:`tiny_parts`
GPT2_DROP = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)  # GPT-2 names these its own way


def _families(hidden: int, layers: int, positions: int) -> dict[str, tuple[str, dict]]:
    """Each family's config class name and its own config arguments at this size."""
    head_dim = hidden // 4
    softcapped = dict(
        head_dim=head_dim, final_logit_softcapping=5.0, query_pre_attn_scalar=head_dim, sliding_window=4
    )
    return {
        "llama": ("LlamaConfig", {}),
        "qwen2": ("Qwen2Config", {}),
        "qwen3": ("Qwen3Config", {"head_dim": head_dim}),
        "mistral": ("MistralConfig", {}),
        "mixtral": ("MixtralConfig", {"num_local_experts": 2, "num_experts_per_tok": 1}),
        "gemma": ("GemmaConfig", {"head_dim": head_dim}),
        "gemma2": ("Gemma2Config", softcapped),
        "gemma3": ("Gemma3TextConfig", softcapped),
        "phi": ("PhiConfig", {}),
        "phi3": ("Phi3Config", {}),
        "gpt2": (
            "GPT2Config",
            {
                "n_embd": hidden,
                "n_layer": layers,
                "n_head": 4,
                "n_positions": positions,
                "n_inner": 2 * hidden,
            },
        ),
        "gpt_neox": ("GPTNeoXConfig", {}),
        "cohere": ("CohereConfig", {"logit_scale": 0.5}),
        "granite": ("GraniteConfig", {"logits_scaling": 4.0}),
        "cohere2": ("Cohere2Config", {"logit_scale": 0.5}),
        "olmo2": ("Olmo2Config", {}),
        "smollm3": ("SmolLM3Config", {}),
        "gptj": ("GPTJConfig", {"n_embd": hidden, "n_layer": layers, "n_head": 4, "rotary_dim": 4}),
        "bloom": ("BloomConfig", {"n_head": 4, "n_layer": layers}),
        "stablelm": ("StableLmConfig", {}),
        "falcon": ("FalconConfig", {}),
    }


FAMILIES = tuple(_families(32, 2, 64))  # every family :func:`tiny_lm` builds


def tiny_lm(
    family: str = "llama",
    *,
    vocab: int = VOCAB,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    dtype=torch.float32,
    positions: int = 64,
    bos: int | None = 1,
    eos: int | None = 2,
    pad: int | None = 0,
    **config,
):
    """A random causal LM of ``family`` (eval mode, frozen), seeded with ``seed``: ``layers`` blocks
    of width ``hidden``, 4 attention heads (2 key/value heads), an MLP of ``2 * hidden``, ``vocab``
    tokens, special-token ids ``bos``/``eos``/``pad``; ``config`` adds or overrides config
    arguments (``tie_word_embeddings=False``, say). Skips the test where this transformers lacks
    the family."""
    import transformers

    cls_name, own = _families(hidden, layers, positions)[family]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"{cls_name} not in transformers {transformers.__version__}")
    kwargs = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=positions,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    if family == "gpt2":
        for k in GPT2_DROP:
            kwargs.pop(k)
    kwargs.update(own)
    kwargs.update(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kwargs)).to(dtype).eval()
    model.requires_grad_(False)
    return model


# -- the engine tests: a float64 model, its parts and a learnable token task -----------------------


def tiny_parts(seed: int = 0, layers: int = 3, hidden: int = 32, dtype=torch.float64):
    """``(model, parts)``: the untied Llama of the engine tests, over :func:`sequences`' vocabulary
    (no pad token)."""
    model = tiny_lm(
        vocab=SEQUENCE_VOCAB,
        hidden=hidden,
        layers=layers,
        seed=seed,
        dtype=dtype,
        positions=128,
        pad=None,
        tie_word_embeddings=False,
    )
    return model, find_parts(model)


def sequences(n: int, seed: int = 0, answers: int = 2, eos: int = 1) -> list[Encoded]:
    """A learnable synthetic task: the answer token is a function of the prompt's first token."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=gen))
        prompt = torch.randint(3, SEQUENCE_VOCAB, (length,), generator=gen).tolist()
        answer = 3 + (prompt[0] % answers)
        out.append(Encoded(tuple(prompt), (answer, eos), has_eos=True))
    return out


# -- a word-level tokenizer, a model that matches it, saved folders and tasks ----------------------

CORPUS = [
    "Review: a charming and often affecting journey .",
    "Sentiment (positive or negative): positive negative",
    "Question: Which technology was developed most recently? Answer: cellular telephone",
    "television refrigerator airplane yes no",
    "A man is sitting on a roof . he starts pulling up roofing",
    "a b c d e f g h the of to is was",
    "zzzzzzzzzzzzzzzzzzzz",
]
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]


def tiny_tokenizer(extra: list[str] | None = None):
    """A ``PreTrainedTokenizerFast`` over a word-level model: one token per word or punctuation
    mark (leading spaces carry no token), no BOS added, EOS ``<eos>``, pad ``<pad>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1)
    tok.train_from_iterator(CORPUS + list(extra or []), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
    )


def tiny_model(tokenizer, seed: int = 0, dtype=torch.float32):
    """A random 2-block untied Llama whose vocabulary and special tokens match ``tokenizer``."""
    specials = dict(bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    return tiny_lm(
        vocab=len(tokenizer), seed=seed, dtype=dtype, positions=256, tie_word_embeddings=False, **specials
    )


WORDS = "a charming and often affecting journey the of to is was b c d e f g h".split()
SENTIMENT_TEMPLATE = "Review: {question}\nSentiment (positive or negative):"


def save_tiny_model(folder: Path) -> Path:
    """A tiny model and its tokenizer saved as an ordinary Hugging Face folder."""
    tok = tiny_tokenizer()
    tiny_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_sentiment_task(path: Path, n: int, rng: random.Random, id_prefix: str = "x") -> Path:
    """``n`` random SST-2-like rows (label: whether the first word is one of the first eight)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            words = rng.choices(WORDS, k=rng.randint(3, 8))
            row = {
                "id": f"{id_prefix}{i}",
                "question": " ".join(words),
                "passage": None,
                "choices": ["negative", "positive"],
                "label": int(words[0] in WORDS[:8]),
            }
            f.write(json.dumps(row) + "\n")
    return path


def save_model_and_task(root: Path, n: int, seed: int = 0) -> Path:
    """``root/model`` (:func:`save_tiny_model`) and ``root/task.jsonl`` with ``n`` rows."""
    save_tiny_model(root / "model")
    write_sentiment_task(root / "task.jsonl", n, random.Random(seed))
    return root


def tiny_cli_args(root: Path) -> list[str]:
    """The ``loca`` flags that point at :func:`save_model_and_task`'s folder, on the CPU, r = k = 4."""
    return [
        "--model",
        str(root / "model"),
        "--task",
        str(root / "task.jsonl"),
        "--template",
        SENTIMENT_TEMPLATE,
        "--device",
        "cpu",
        "--rank",
        "4",
        "--feedback-rank",
        "4",
    ]
