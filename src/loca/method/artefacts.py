"""LoCA's artefacts on disk, one folder format each, written atomically and read with errors that
name the file: the adapter (``loca_adapter.safetensors``, ``loca_adapter.json``, a model card),
the feedback maps (``feedback_maps.safetensors``, ``feedback_config.json``) and a fit's resumable
state (``fit_state.safetensors``, ``fit_state.json``), plus the checkpoint-fingerprint check they
share. Tensors and configs go in and come out as dicts: the classes they belong to
(:class:`loca.method.adapters.ResidualAdapters`, :class:`loca.method.maps.FeedbackMaps`,
:class:`loca.method.state.FitState`) convert, so this module imports none of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from ..infra.io import atomic_dir, atomic_write_json

# loca's own file names: PEFT's (adapter_model.safetensors, adapter_config.json) would make PEFT
# and transformers mistake the folder for a PEFT adapter they cannot read. Folders written with
# those names by earlier versions still load.
ADAPTER_WEIGHTS = "loca_adapter.safetensors"
ADAPTER_CONFIG = "loca_adapter.json"
LEGACY_NAMES = ("adapter_model.safetensors", "adapter_config.json")
CONFIG_NAMES = (ADAPTER_CONFIG, LEGACY_NAMES[1])
MAPS_WEIGHTS = "feedback_maps.safetensors"
MAPS_CONFIG = "feedback_config.json"
MAPS_FORMAT = "loca-feedback-maps"
FIT_STATE_WEIGHTS = "fit_state.safetensors"
FIT_STATE_CONFIG = "fit_state.json"
FIT_STATE_FORMAT = "loca-fit-state"


def write_adapter(directory: str | Path, tensors: dict[str, Tensor], config: dict) -> Path:
    """The adapter folder: weights, config (``format`` added) and a model-card ``README.md``."""
    config = {"format": "loca-adapter", "version": 1, **config}
    with atomic_dir(directory, CONFIG_NAMES, "loca-adapter") as tmp:
        save_file(tensors, tmp / ADAPTER_WEIGHTS)
        atomic_write_json(tmp / ADAPTER_CONFIG, config)
        (tmp / "README.md").write_text(_model_card(config))
    return Path(directory)


def read_adapter(
    directory: str | Path, current: dict, hidden_size: int
) -> tuple[dict[str, Tensor], dict, Path]:
    """``(tensors, config, weights file)`` of an adapter folder made for the checkpoint whose
    fingerprint is ``current`` (folders with the legacy PEFT-like names load too)."""
    directory = Path(directory)
    cfg, cfg_path = _adapter_config(directory)
    weights_name = ADAPTER_WEIGHTS if cfg_path.name == ADAPTER_CONFIG else LEGACY_NAMES[0]
    base = cfg.get("base_model")
    check_fingerprint(
        cfg.get("fingerprint"), current, f"{directory} (fitted on {base})" if base else str(directory)
    )
    rank, seed = cfg.get("rank"), cfg.get("seed")
    if not isinstance(rank, int) or not 1 <= rank <= hidden_size or not isinstance(seed, int):
        raise ValueError(
            f"{cfg_path}: 'rank' must be an integer in 1..{hidden_size} and 'seed' an "
            f"integer (got rank={rank!r}, seed={seed!r})"
        )
    return read_safetensors(directory / weights_name), cfg, directory / weights_name


def read_adapter_config(directory: str | Path) -> dict:
    """The config of an adapter folder (``loca_adapter.json``, or the legacy name), checked to be
    a LoCA adapter's; the weights are not read and no checkpoint is needed (to learn which base
    model and task the adapter records: :func:`recorded_base`, :func:`recorded_task`)."""
    return _adapter_config(Path(directory))[0]


def _adapter_config(directory: Path) -> tuple[dict, Path]:
    cfg_path = directory / ADAPTER_CONFIG
    if not cfg_path.is_file() and (directory / LEGACY_NAMES[1]).is_file():
        cfg_path = directory / LEGACY_NAMES[1]
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory / ADAPTER_CONFIG} not found: not a LoCA adapter folder")
    cfg = read_json_object(cfg_path)
    if cfg.get("format") != "loca-adapter":
        raise ValueError(f"{cfg_path}: not a LoCA adapter config (format {cfg.get('format')!r})")
    return cfg, cfg_path


# how an adapter config records what it was fitted on: (key of the name as given, key of its path)
BASE_KEYS = ("base_model", "base_model_path")
TASK_KEYS = ("task_source", "task_path")


def source_record(name: str, keys: tuple[str, str], local: bool = True) -> dict:
    """How an adapter config records a model or task named ``name`` (``keys``: :data:`BASE_KEYS`
    or :data:`TASK_KEYS`): the name as the user gave it (alias, hub id, registry task or path),
    and the absolute path when ``local`` and ``name`` is an existing file or folder (so that a
    relative path still loads from another working directory), else None."""
    path = Path(name).expanduser()
    return {keys[0]: name, keys[1]: str(path.resolve()) if local and path.exists() else None}


def _located(config: dict, keys: tuple[str, str]) -> str | None:
    """The recorded name (see :func:`source_record`) in a form that loads from here: the name as
    given, unless it is a path that does not exist from here and the recorded absolute path does."""
    name, absolute = config.get(keys[0]), config.get(keys[1])
    if not isinstance(name, str) or not name:
        return None
    if isinstance(absolute, str) and not Path(name).expanduser().exists() and Path(absolute).exists():
        return absolute
    return name


def recorded_base(config: dict) -> tuple[str | None, str | None]:
    """``(model, revision)``: the base model an adapter config records, as :func:`load_model
    <loca.models.parts.load_model>` takes it (None if it records none), and its hub revision
    (the commit it was loaded at, if any)."""
    revision = config.get("base_model_revision")
    return _located(config, BASE_KEYS), revision if isinstance(revision, str) else None


def recorded_task(config: dict) -> dict:
    """What an adapter config records of the task it was fitted on: ``task`` (a registry name or
    a JSON Lines path that loads from here), ``template`` and ``add_eos``, each present only if
    recorded. Adapters of earlier versions record only the task's name (``config["task"]``,
    which for a user task is its file's stem): none of these."""
    out = {}
    task = _located(config, TASK_KEYS)
    if task is not None:
        out["task"] = task
    if isinstance(config.get("template"), str):
        out["template"] = config["template"]
    if isinstance(config.get("add_eos"), bool):
        out["add_eos"] = config["add_eos"]
    return out


def write_maps(directory: str | Path, tensors: dict[str, Tensor], config: dict) -> Path:
    """The feedback-map folder: factors and config (``format`` added)."""
    with atomic_dir(directory, MAPS_CONFIG, MAPS_FORMAT) as tmp:
        save_file(tensors, tmp / MAPS_WEIGHTS)
        atomic_write_json(tmp / MAPS_CONFIG, {"format": MAPS_FORMAT, "version": 1, **config})
    return Path(directory)


def read_maps(directory: str | Path, current: dict | None) -> tuple[dict[str, Tensor], dict]:
    """``(tensors, config)`` of a feedback-map folder; with ``current``, refused for another
    checkpoint than the one with that fingerprint."""
    directory = Path(directory)
    cfg_path = directory / MAPS_CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: not a LoCA feedback-map folder")
    cfg = read_json_object(cfg_path)
    if cfg.get("format") != MAPS_FORMAT or not isinstance(cfg.get("fingerprint"), dict):
        raise ValueError(f"{cfg_path}: not a LoCA feedback-map config")
    if current is not None:
        check_fingerprint(cfg.get("fingerprint"), current, f"feedback maps {directory}")
    return read_safetensors(directory / MAPS_WEIGHTS), cfg


def write_fit_state(
    directory: str | Path, tensors: dict[str, Tensor], meta: dict, write_maps: Callable[[Path], object] | None
) -> None:
    """A fit-state folder: tensors, ``meta`` (``format`` added) and, if given, the re-calibrated
    maps written by ``write_maps`` into ``maps/``; replaced in one rename."""
    with atomic_dir(directory, FIT_STATE_CONFIG, FIT_STATE_FORMAT) as tmp:
        save_file(tensors, tmp / FIT_STATE_WEIGHTS)
        if write_maps is not None:
            write_maps(tmp / "maps")
        atomic_write_json(tmp / FIT_STATE_CONFIG, {"format": FIT_STATE_FORMAT, "version": 2, **meta})


# the keys of fit_state.json and the JSON types of their values
_NUMBER, _INT = (int, float), (int,)
FIT_STATE_KEYS = {
    "iteration": _INT,
    "frozen_ce": _NUMBER,
    "num_blocks": _INT,
    "trajectories": (list,),
    "best": (dict,),
    "history": (list,),
    "elapsed_s": _NUMBER,
    "recalibrations": _INT,
    "recalibration_s": _NUMBER,
    "maps": (bool,),
}


def read_fit_state(directory: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """``(meta, tensors)`` of a fit-state folder (its re-calibrated maps, if any, checked present).
    A missing, unreadable, truncated or partial ``fit_state.json`` (a key missing or of the wrong
    type) or ``fit_state.safetensors`` (unreadable, or holding NaN/Inf) is a ValueError naming the
    file: a fit state is never half read."""
    directory = Path(directory)
    path = directory / FIT_STATE_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a complete LoCA fit state")
    meta = read_json_object(path)
    if meta.get("format") != FIT_STATE_FORMAT:
        raise ValueError(f"{path}: not a LoCA fit state (format {meta.get('format')!r})")
    bad = [
        key
        for key, kinds in FIT_STATE_KEYS.items()
        if not isinstance(meta.get(key), kinds) or (bool not in kinds and isinstance(meta.get(key), bool))
    ]
    if bad:
        raise ValueError(
            f"{path}: missing or malformed {', '.join(bad)} (a partial or edited fit state); "
            "it cannot be resumed"
        )
    tensors = read_safetensors(directory / FIT_STATE_WEIGHTS)
    nonfinite = sorted(k for k, t in tensors.items() if t.is_floating_point() and not t.isfinite().all())
    if nonfinite:
        raise ValueError(
            f"{directory / FIT_STATE_WEIGHTS}: holds NaN/Inf (in {', '.join(nonfinite[:3])}); "
            "a fit never saves such a state, so the file is damaged; it cannot be resumed"
        )
    if meta["maps"] and not (directory / "maps" / MAPS_CONFIG).is_file():
        raise ValueError(f"{directory}: the re-calibrated maps are missing")
    return meta, tensors


def _model_card(config: dict) -> str:
    """A short README for an adapter folder: what it is and how to load it."""
    sel = config.get("selection") or {}
    lines = [
        "# LoCA adapter",
        "",
        "Residual low-rank adapters `h_l = hbar_l + B_l A_l h_{l-1}` for every transformer block,",
        "fitted forward-only by [loca](https://pypi.org/project/loca/) (Local Credit Assignment).",
        "",
        f"- base model: `{config.get('base_model')}`"
        + (f" at revision `{config['base_model_revision']}`" if config.get("base_model_revision") else "")
        + " (weights fingerprint "
        f"`{config['fingerprint']['weights_sha256'][:16]}…`, {config['num_blocks']} blocks, "
        f"d = {config['hidden_size']})",
        f"- rank r = {config['rank']}, feedback rank k = {config.get('feedback_rank', 'n/a')}, "
        f"seed {config['seed']}",
        f"- task: {config.get('task', 'n/a')}; selection: held-out CE {sel.get('heldout_ce', 'n/a')} "
        f"at iteration {sel.get('iteration', 'n/a')} (η {sel.get('eta', 'n/a')})",
        *_task_lines(config),
        *_metrics_lines(config.get("metrics")),
        "",
        "```python",
        "import loca",
        'model, tokenizer, adapters = loca.load_adapted("<this folder>")  # the base model it records',
        "# or, on a model already loaded:",
        'adapters = loca.from_pretrained(model, "<this folder>")  # attached; .unload() removes them',
        "```",
        "",
        "`loca generate --adapter <this folder> --prompt ...` and `loca evaluate --adapter <this folder>",
        "--out DIR` load the base model (and task) recorded here unless `--model` (`--task`) is given.",
        "",
        "Not a PEFT adapter: PEFT and transformers cannot load it; loca checks the base model's",
        "fingerprint and refuses another checkpoint.",
        "",
    ]
    return "\n".join(lines)


def _task_lines(config: dict) -> list[str]:
    if "task_source" not in config:
        return []
    return [
        f"- task source: `{config['task_source']}`; template {json.dumps(config.get('template'))}; "
        f"add_eos {config.get('add_eos')}"
    ]


def _metrics_lines(metrics: dict | None) -> list[str]:
    if not metrics:
        return []
    f, m = metrics["frozen"], metrics["loca"]
    return [
        f"- test ({m['n_test']} examples): CE {f['test_ce']:.4f} → {m['test_ce']:.4f}, "
        f"acc {f['test_acc']:.3f} → {m['test_acc']:.3f} (frozen → LoCA)"
    ]


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path``, or a ValueError naming the file."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return obj


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file, or a ValueError naming the file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return load_file(path)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


class CheckpointMismatchError(ValueError):
    """An artefact was fitted on a different checkpoint than the model it is used with."""


def check_fingerprint(saved: dict | None, current: dict, what: str) -> None:
    if isinstance(saved, dict) and saved.get("fingerprint_version") != current.get("fingerprint_version"):
        raise CheckpointMismatchError(
            f"{what} was saved by an older loca whose checkpoint fingerprint cannot be checked "
            "against this one; calibrate/fit again"
        )
    if saved != current:
        diff = [k for k in current if (saved or {}).get(k) != current[k]]
        raise CheckpointMismatchError(
            f"{what} was made for another checkpoint (differs in: {', '.join(diff) or 'all'}); "
            "calibrate/fit again for this model"
        )
