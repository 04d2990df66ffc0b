"""Model plumbing: load a causal LM, find its blocks, final norm and head, fingerprint it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.head import LogitTransform

FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm")


class UnsupportedModelError(ValueError):
    """The model's layout is not one LoCA can attach to."""


@dataclass
class ModelParts:
    """The pieces of a decoder-only LM that LoCA touches. Nothing here owns any weights."""

    model: nn.Module
    backbone: nn.Module
    blocks: nn.ModuleList
    final_norm: nn.Module
    head: nn.Module
    transform: LogitTransform
    hidden_size: int
    vocab_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_devices(self) -> list[torch.device]:
        """The device of each block (they differ when a model is spread over several GPUs)."""
        return [next(b.parameters()).device for b in self.blocks]

    @property
    def device(self) -> torch.device:
        """The head's device: where batches, head errors and losses live."""
        return self.head.weight.device

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the hidden states between blocks (the input embeddings')."""
        return self.model.get_input_embeddings().weight.dtype

    def final_hidden(self, input_ids, attention_mask, pos_b, pos_t, inputs_embeds=None):
        """Normalised final hidden states ``n(h_L)`` at the predict positions (N×d), on the head's
        device.

        The backbone is run without the LM head, so no logits are formed anywhere.
        """
        kwargs = dict(attention_mask=attention_mask, use_cache=False)
        if inputs_embeds is None:
            out = self.backbone(input_ids=input_ids, **kwargs)
        else:
            out = self.backbone(inputs_embeds=inputs_embeds, **kwargs)
        return at_positions(out.last_hidden_state, pos_b, pos_t).to(self.device)


def at_positions(h: torch.Tensor, pos_b: torch.Tensor, pos_t: torch.Tensor) -> torch.Tensor:
    """``h[pos_b, pos_t]`` on ``h``'s device (a model spread over GPUs has its blocks' hidden
    states on several devices; the positions live with the batch)."""
    if pos_b.device != h.device:
        pos_b, pos_t = pos_b.to(h.device), pos_t.to(h.device)
    return h[pos_b, pos_t]


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logit_transform(config) -> LogitTransform:
    """The fixed map from head outputs to logits that the model's own forward applies."""
    cfg = _text_config(config)
    scale = 1.0
    if getattr(cfg, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(cfg.logit_scale)
    if getattr(cfg, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(cfg.logits_scaling)
    softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


def find_parts(model: nn.Module) -> ModelParts:
    """Locate backbone, block list, final norm and head of a Hugging Face causal LM.

    The block list is the one ``nn.ModuleList`` in the backbone whose length equals the config's
    number of layers; the final norm is found by its conventional attribute name.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    backbone = getattr(model, "base_model", None)
    if config is None or head is None or backbone is None or backbone is model:
        raise UnsupportedModelError(
            f"{name} is not a Hugging Face causal LM with a separate backbone and output head"
        )
    cfg = _text_config(config)
    n_layers = getattr(cfg, "num_hidden_layers", None)
    lists = [m for m in backbone.children() if isinstance(m, nn.ModuleList) and len(m) > 0]
    matching = [m for m in lists if n_layers is None or len(m) == n_layers]
    if len(matching) != 1:
        raise UnsupportedModelError(
            f"{name}: expected exactly one list of {n_layers} transformer blocks in "
            f"{type(backbone).__name__}, found {len(matching)}; LoCA supports decoder-only models "
            "whose blocks form one list"
        )
    final_norm = next(
        (getattr(backbone, n) for n in FINAL_NORM_NAMES if isinstance(getattr(backbone, n, None), nn.Module)),
        None,
    )
    if final_norm is None:
        raise UnsupportedModelError(
            f"{name}: no final norm found on {type(backbone).__name__} (looked for {FINAL_NORM_NAMES})"
        )
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        raise UnsupportedModelError(f"{name}: the output head has no 2-D weight")
    return ModelParts(
        model=model,
        backbone=backbone,
        blocks=matching[0],
        final_norm=final_norm,
        head=head,
        transform=logit_transform(config),
        hidden_size=head.weight.shape[1],
        vocab_size=head.weight.shape[0],
    )


FINGERPRINT_VERSION = 2
_SAMPLE = 4096  # elements hashed per tensor


def fingerprint(parts: ModelParts) -> dict:
    """Identify a checkpoint: its config plus a hash over **every** parameter tensor.

    Each tensor contributes its name and an evenly strided sample of up to 4096 of its elements,
    rounded to bfloat16 (so float32 and bfloat16 loads of one checkpoint agree): any fine-tune
    that changes a weight matrix densely (full tuning, a merged LoRA on any module) changes the
    hash, at the cost of reading a few thousand numbers per tensor.
    """
    cfg = _text_config(parts.model.config)
    digest = hashlib.sha256()
    for name, p in sorted(parts.model.named_parameters(), key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE)
        sample = flat[::step][:_SAMPLE].to("cpu", torch.bfloat16).float()
        digest.update(name.encode())
        digest.update(sample.numpy().tobytes())
    return {
        "fingerprint_version": FINGERPRINT_VERSION,
        "model_type": getattr(cfg, "model_type", type(parts.model).__name__),
        "hidden_size": parts.hidden_size,
        "num_blocks": parts.num_blocks,
        "vocab_size": parts.vocab_size,
        "weights_sha256": digest.hexdigest(),
    }


ARCH_PREFIX = "arch:"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    """``auto``/None: CUDA if available, else the CPU; otherwise a checked device string."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine (use cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise ValueError(f"--device {device}: this machine has {n} CUDA device(s)")
    elif dev.type not in ("cpu", "mps"):
        raise ValueError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    return dev


def clamp_max_length(max_length: int, model) -> tuple[int, str | None]:
    """``max_length`` limited to the model's context, and a note saying so when it had to be."""
    limit = context_length(model)
    if limit is None or max_length <= limit:
        return max_length, None
    return limit, f"max_length {max_length} exceeds the model's context of {limit} tokens; using {limit}"


def context_length(model) -> int | None:
    """The longest sequence the model's position embeddings cover, if its config says."""
    cfg = _text_config(model.config)
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_model(
    name: str,
    device: str | None = None,
    dtype: str = "float32",
    random_init: bool = False,
    seed: int = 0,
    trust_remote_code: bool = False,
    device_map: str | None = None,
    revision: str | None = None,
):
    """Load ``(model, tokenizer)`` from a local folder, a built-in offline alias, a hub id, or
    ``arch:NAME`` (a published architecture with random weights, :mod:`loca.models.archs`).

        With ``random_init`` only the config and tokenizer are read and the weights are drawn at
        random (seeded): for time and memory measurements of an architecture, which do not depend on
        the weights' values. The model is put in eval mode with every parameter frozen. Code shipped
        with a model folder or hub repo (``auto_map``) is never run unless ``trust_remote_code``.
        ``device_map`` (``auto``, ``balanced``, ``sequential``) spreads the model's blocks over the
        GPUs through accelerate, for a model larger than one device (``device`` is then ignored).
        ``revision``: the commit, branch or tag of a hub id (ignored for folders and aliases).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .zoo import ALIASES, ensure_alias

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    target = None if device_map else resolve_device(device)  # a bad --device fails first
    if device_map and not torch.cuda.is_available():
        raise ValueError(f"--device-map {device_map}: needs CUDA devices to spread the model over")
    path: str | Path = name
    if name in ALIASES:
        path = ensure_alias(name)
    elif name.startswith(ARCH_PREFIX):  # a published architecture without weights
        from .archs import arch_folder

        path, random_init = arch_folder(name), True
    try:
        remote = {"trust_remote_code": trust_remote_code}
        if revision is not None and isinstance(path, str) and not Path(path).exists():
            remote["revision"] = revision  # a hub id's commit
        tokenizer = AutoTokenizer.from_pretrained(path, **remote)
        if random_init:
            from transformers.initialization import no_init_weights

            config = AutoConfig.from_pretrained(path, **remote)
            with no_init_weights():  # allocation only: the weights are drawn where they will live
                model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], **remote)
            model.tie_weights()  # skipped under no_init_weights
            model = _dispatch(model, device_map) if device_map else model.to(target)
            _draw_weights(model, seed, getattr(config, "initializer_range", 0.02))
        else:
            placement = {"device_map": device_map} if device_map else {}
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], **remote, **placement)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"could not load model {name!r}: not a model folder, not a built-in alias "
            f"({', '.join(ALIASES)}), and the hub could not provide it ({first})"
        ) from exc
    except Exception as exc:
        if "safetensor" not in type(exc).__name__.lower() or not Path(path).is_dir():
            raise
        files = ", ".join(str(p) for p in sorted(Path(path).glob("*.safetensors"))) or str(path)
        raise ValueError(
            f"{files}: not a readable safetensors weights file ({exc}); copy the model again"
        ) from exc
    if target is not None:
        model.to(target)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


@torch.no_grad()
def _draw_weights(model, seed: int, std: float) -> None:
    """Seeded random weights on each parameter's own device: N(0, std²) for matrices and
    embeddings, 1 for norm scales, 0 for biases (the usual initialisation, drawn on the GPU)."""
    gen: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        g = gen.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
        if p.dim() == 1:
            p.fill_(1.0 if "norm" in name else 0.0)
        else:
            p.normal_(0.0, std, generator=g)


def _dispatch(model, device_map: str):
    """Spread an in-memory model's blocks over the GPUs (accelerate), no block split."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = getattr(model, "_no_split_modules", None) or []
    balanced = device_map != "sequential"
    memory = get_balanced_memory(model, no_split_module_classes=no_split) if balanced else None
    placement = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    return dispatch_model(model, device_map=placement)
