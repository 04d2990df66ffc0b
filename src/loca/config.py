"""Configuration of a LoCA run, in sections: :class:`ModelConfig` (which model, where),
:class:`DataConfig` (which task, how many examples) and :class:`LocaConfig` (the method: its
calibration, fit and shared fields, each field tagged with its section). The Python API takes
these objects, the CLI flags are generated from them, and a run's ``config.json`` stores them
under ``model``, ``data`` and ``loca``: one name per quantity everywhere."""

from __future__ import annotations

import math
import types
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from typing import Self, Union, get_args, get_origin, get_type_hints

# The sections of LocaConfig's fields, in the order the CLI shows them.
SECTIONS = {
    "calibration": "Stage I: the feedback maps",
    "fit": "Stage II: the forward-only fit and its selection",
    "shared": "sequences, batches and seed (every stage)",
}


def option(default, help: str, *, choices: tuple | dict | None = None, **kw):
    """A dataclass field with its help text (the CLI flag's help) and, for LocaConfig, its
    ``section``; lists get a default factory. ``choices`` is the one place an option's allowed
    values are spelled: a tuple, or a dict from each value to what it means. :class:`Settings`
    refuses any other value, the CLI flag offers exactly these, and the help text lists them
    (``help: 'a' = meaning; 'b' = meaning`` for a dict, ``help: a, b or c`` for a tuple)."""
    if choices is not None:
        kw["choices"] = tuple(choices)
        help = f"{help}: {_describe(choices)}"
    if isinstance(default, list | tuple):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _describe(choices: tuple | dict) -> str:
    if isinstance(choices, dict):
        return "; ".join(f"{value!r} = {meaning}" for value, meaning in choices.items())
    return f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]


def positive_finite(values) -> bool:
    """A non-empty list of finite values > 0 (a list of candidates: η, λ_rel, learning rates, ε)."""
    return bool(values) and all(x > 0 and math.isfinite(x) for x in values)


@cache
def field_types(cls) -> dict[str, object]:
    """Each field's type from the class's real annotations, ``X | None`` as ``X``: ``bool``,
    ``int``, ``float``, ``str`` or ``list[...]`` (what the CLI and the normalisation go by)."""
    out = {}
    for name, hint in get_type_hints(cls).items():
        if get_origin(hint) in (Union, types.UnionType):
            hint = next(a for a in get_args(hint) if a is not type(None))
        out[name] = hint
    return out


@cache
def accepts_none(cls, name: str) -> bool:
    """Whether the field's annotation allows None (``X | None``)."""
    return type(None) in get_args(get_type_hints(cls)[name])


class Settings:
    """What the settings dataclasses share (the run's sections and the baselines' settings, all
    frozen once built): the dict round trip that a run's configuration files use, and the one
    validation path. On construction (and every ``dataclasses.replace``) list fields become lists
    and their ``float`` elements floats (so a JSON ``1`` is recorded as ``1.0``), then every field
    whose value is not among its ``choices`` or fails the class's :meth:`checks` is named in one
    ValueError."""

    def __post_init__(self) -> None:
        for name, kind in field_types(type(self)).items():
            value = getattr(self, name)
            if get_origin(kind) is list and value is not None:
                convert = float if get_args(kind) == (float,) else None
                object.__setattr__(self, name, [convert(x) for x in value] if convert else list(value))
        self.refuse_invalid(self.checks())

    def checks(self) -> dict[str, bool]:
        """Field name → whether its value is valid, beyond the ``choices`` that every field
        declaring them is checked against."""
        return {}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Self:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
        return cls(**d)

    def refuse_invalid(self, checks: dict[str, bool]) -> None:
        """Raise a ValueError naming (with its value, and the allowed values where there are
        choices) every field that is not among its choices or whose check is False."""
        unknown = set(checks) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"{type(self).__name__}.checks() names no field: {sorted(unknown)}")
        bad = []
        for f in fields(self):
            value, allowed = getattr(self, f.name), f.metadata.get("choices")
            off_choices = allowed is not None and value not in allowed
            if off_choices and value is None and accepts_none(type(self), f.name):
                off_choices = False
            if off_choices:
                bad.append(f"{f.name}={value!r} (choose from {', '.join(allowed)})")
            elif not checks.get(f.name, True):
                bad.append(f"{f.name}={value!r}")
        if bad:
            raise ValueError(f"invalid {type(self).__name__} values: {', '.join(bad)}")


def choices(cls, name: str) -> tuple | None:
    """The allowed values of the field ``name`` of ``cls`` (None: any value of its type)."""
    return next(f.metadata.get("choices") for f in fields(cls) if f.name == name)


# Allowed values shared by more than one class (LoCA's A and Adapter-BP's, which trains the same A).
A_INITS = {
    "random": "N(0, 1/d) from (seed, block)",
    "principal": "the top-r principal directions of each block's input at the predict positions (one "
    "extra forward pass over the training data, streamed as a Nyström sketch)",
}
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LocaConfig(Settings):
    """Hyper-parameters of calibration (Stage I) and forward-only fitting (Stage II)."""

    rank: int = option(32, "adapter rank r (A is r×d, fixed; B is d×r, fitted)", section="fit")
    feedback_rank: int = option(32, "rank k of each block's feedback map F_l", section="calibration")
    beta_rel: float = option(
        1.0, "relative ridge of the feedback fit: β = β_rel·trace(EᵀE)/d", section="calibration"
    )
    feedback_gate: str = option(
        "none",
        "which map a predict position's head error goes through",
        section="calibration",
        choices={
            "none": "one map per block (the paper)",
            "role": "one map per block and position role (the prompt's last position, inside the "
            "completion, the position predicting EOS), each fitted on its role's probe rows",
        },
    )
    lam_rel: list[float] = option(
        [1e-3],
        "relative ridge candidates of the adapter solve: λ = λ_rel·trace(G)/r",
        section="fit",
    )
    ridge_center: str = option(
        "zero",
        "what the adapter solve's ridge pulls B' towards",
        section="fit",
        choices={
            "zero": "λ||B'||², the paper (it also shrinks B every iteration)",
            "previous": "λ||B' − B||²: a damped step, no shrinkage",
        },
    )
    etas: list[float] = option(
        [0.003, 0.01, 0.03],
        "dimensionless step sizes η: fixed control runs one trajectory per value; adaptive control "
        "starts at the first",
        section="fit",
    )
    step_scale: str = option(
        "rms",
        "target step",
        section="fit",
        choices={
            "rms": "η relative to the residual stream (η·RMS(h)/RMS(F e) per block and batch)",
            "absolute": "η as an absolute step (the paper's unnormalised ablation)",
        },
    )
    step_control: str = option(
        "adaptive",
        "how η is chosen",
        section="fit",
        choices={
            "fixed": "one trajectory per η candidate, each at its fixed η (the paper)",
            "adaptive": "one trajectory that starts at the first η, grows η by eta_grow after every "
            "step that lowers the held-out CE and, after a step that does not, restores B and "
            "retries with η·eta_shrink on the same training statistics (no new training pass)",
        },
    )
    eta_grow: float = option(1.5, "adaptive control: η factor after an accepted step (≥ 1)", section="fit")
    eta_shrink: float = option(0.5, "adaptive control: η factor after a rejected step (< 1)", section="fit")
    a_init: str = option("random", "the fixed down-projection A", section="fit", choices=A_INITS)
    recalibrate_every: int = option(
        0,
        "adaptive control: refit the feedback maps at the current adapters after every this many "
        "accepted steps (0 = never; each refit costs one probe backward pass, so the fit is no "
        "longer forward-only)",
        section="fit",
    )
    probe_synthetic: int = option(
        0,
        "synthetic head-error sets per probe position (0 = none, the paper): each is one more "
        "backward pass through the probe's forward with the error W_u[j] − W_u[y] of a model that "
        "put its mass on another answer token j (drawn from the probe's target tokens); pooled with "
        "the natural errors at equal total weight, they fit the maps along the error directions that "
        "remain once the answer format is learned. Stage I cost only; Stage II stays forward-only",
        section="calibration",
    )
    calibration_rounds: int = option(
        1,
        "Stage I probes, pooled: after the first, each further probe is taken at the adapters of a "
        "short forward-only fit with the maps so far (1 = the paper's single probe at B = 0); "
        "Stage II itself stays forward-only",
        section="calibration",
    )
    calibration_round_iters: int = option(
        5, "steps tried by each calibration round's short fit", section="calibration"
    )
    alignment_every: int = option(
        0,
        "diagnostic: every this many iterations, measure the maps' alignment with the true "
        "gradients on the held-out probe at the best adapters so far (one probe backward each; "
        "0 = never; changes no result)",
        section="fit",
    )
    cuda_graphs: bool = option(
        True,
        "on a single CUDA device, capture each training batch's Stage II forward (with the head "
        "error and the adapter codes) as a CUDA graph on its first pass and replay it after: the "
        "kernel launches are paid once (results equal to float rounding)",
        section="fit",
    )
    max_iters: int = option(
        20, "maximum number of outer iterations T_max (adaptive: of steps tried)", section="fit"
    )
    patience: int = option(
        3,
        "stop a trajectory after this many iterations (adaptive: tries) without held-out improvement",
        section="fit",
    )
    groups: int = option(1, "Gauss–Seidel groups: 1 = Jacobi, num_blocks = full Gauss–Seidel", section="fit")
    probe_positions: int = option(
        1000, "minimum number of predict positions in the calibration probe", section="calibration"
    )
    probe_checkpoint: bool = option(
        True,
        "recompute each block in the probe's backward instead of keeping its activations (the "
        "probe's peak memory is then the block boundaries plus one block; the same maps)",
        section="calibration",
    )
    probe_memory_mb: float = option(
        0.0,
        "memory budget of one probe micro-batch in MB: micro-batches then also hold at most the "
        "padded tokens that fit it, measured by a trial step on the longest sequence (0 = off: "
        "probe_micro_batch sequences only)",
        section="calibration",
    )
    probe_micro_batch: int = option(
        8, "sequences per probe micro-batch (bounds the probe's peak memory)", section="calibration"
    )
    batch_size: int = option(16, "sequences per forward batch in Stage II and evaluation", section="shared")
    max_length: int = option(
        256, "maximum tokens per sequence; prompts are truncated from the left", section="shared"
    )
    add_eos: bool = option(True, "append EOS to the completion (and train on it)", section="shared")
    seed: int = option(0, "seed of A, probe sampling and random diagnostics", section="shared")

    def checks(self) -> dict[str, bool]:
        return {
            "rank": self.rank >= 1,
            "feedback_rank": self.feedback_rank >= 1,
            "beta_rel": self.beta_rel > 0 and math.isfinite(self.beta_rel),
            "lam_rel": positive_finite(self.lam_rel),
            "etas": positive_finite(self.etas),
            "eta_grow": 1 <= self.eta_grow < math.inf,
            "eta_shrink": 0 < self.eta_shrink < 1,
            "recalibrate_every": self.recalibrate_every >= 0
            and (self.recalibrate_every == 0 or self.step_control == "adaptive"),
            "alignment_every": self.alignment_every >= 0,
            "calibration_rounds": self.calibration_rounds >= 1,
            "probe_synthetic": self.probe_synthetic >= 0,
            "calibration_round_iters": self.calibration_round_iters >= 1,
            "max_iters": self.max_iters >= 0,
            "patience": self.patience >= 1,
            "groups": self.groups >= 1,
            "probe_positions": self.probe_positions >= 1,
            "probe_micro_batch": self.probe_micro_batch >= 1,
            "probe_memory_mb": self.probe_memory_mb >= 0 and math.isfinite(self.probe_memory_mb),
            "batch_size": self.batch_size >= 1,
            "max_length": self.max_length >= 2,
        }

    @classmethod
    def preset(cls, name: str, **overrides) -> LocaConfig:
        """A named configuration (see :data:`PRESETS`) with ``overrides`` on top."""
        return cls(**{**preset_values(name), **overrides})


# Named configurations. "paper" is the method as the paper states it (random A, fixed-η
# trajectories, one calibration); it stays reproducible whatever the defaults become.
PRESETS: dict[str, dict] = {
    "paper": dict(
        rank=32,
        feedback_rank=8,
        beta_rel=1e-3,
        feedback_gate="none",
        lam_rel=[1e-3],
        ridge_center="zero",
        etas=[0.003, 0.01, 0.03],
        step_scale="rms",
        step_control="fixed",
        a_init="random",
        recalibrate_every=0,
        calibration_rounds=1,
        probe_synthetic=0,
        max_iters=40,
        patience=3,
        groups=1,
        probe_positions=1000,
    ),
    "default": {},
}


def preset_values(name: str) -> dict:
    """The LoCA settings a preset sets (the fields it leaves out keep their defaults)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return dict(PRESETS[name])


DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelConfig(Settings):
    """Which model to load, where and how."""

    model: str = option(
        DEFAULT_MODEL,
        "local folder, hub id, offline alias (smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct), "
        "or arch:NAME, a published architecture with random weights (arch:qwen2.5-7b, see loca.archs)",
    )
    device: str = option("auto", "cpu, cuda, cuda:1, ... (auto: cuda if available)")
    dtype: str = option(
        "float32", "backbone dtype (adapters and statistics stay float32/float64)", choices=DTYPES
    )
    trust_remote_code: bool = option(
        False, "allow running Python code shipped with the model (auto_map); off by default"
    )
    random_init: bool = option(
        False, "random weights from the model's config and tokenizer (for time/memory measurements)"
    )
    device_map: str | None = option(
        None,
        "spread the model's blocks over the GPUs through accelerate, for a model larger than one "
        "device (replaces --device)",
        choices=("auto", "balanced", "sequential"),
    )

    def checks(self) -> dict[str, bool]:
        return {"model": bool(self.model)}


@dataclass(frozen=True)
class DataConfig(Settings):
    """Which task and how many examples of each split; the splits are drawn with LocaConfig.seed."""

    task: str = option("sst2", "task name (see `loca tasks`) or a JSON Lines file")
    template: str | None = option(None, "prompt template for a JSON Lines task file")
    data_dir: str | None = option(
        None,
        "folder of task folders in loca's JSON Lines schema (default: $LOCA_DATA_DIR, else the HF hub)",
    )
    n_train: int = option(128, "training examples")
    n_heldout: int = option(64, "held-out examples (selection)")
    n_test: int = option(200, "test examples (0: the whole test split)")

    def checks(self) -> dict[str, bool]:  # counts: integers ≥ 0
        return {
            k: isinstance(getattr(self, k), int) and getattr(self, k) >= 0
            for k in ("n_train", "n_heldout", "n_test")
        }


SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "loca": LocaConfig}


def section_of(name: str) -> str | None:
    """The section whose field ``name`` is (the three sections share no field name)."""
    return next((s for s, cls in SECTION_CLASSES.items() if name in {f.name for f in fields(cls)}), None)


def sections_from_dict(obj: dict) -> dict:
    """The sections a JSON/YAML object holds, as dicts of fields whose values are converted as
    their flags would be (:func:`value_from_file`). Two layouts:

    - sectioned: ``{"model": {...}, "data": {...}, "loca": {...}}`` (any of the three). A record
      that loca wrote (a file naming its ``command``: a run's or a comparison's ``config.json``)
      holds other keys beside its sections (the split record, fingerprints, versions, a
      comparison's own settings), which are skipped; ``"model"`` a name string with ``"dtype"``
      beside it is an older record's model section. In a file without ``command`` any other
      top-level key is refused;
    - flat: every setting at the top level (``{"model": "m", "n_train": 24, "rank": 8}``), each
      going to the section that has a field of that name.

    An unknown section, a setting outside its section in a sectioned file, an unknown setting and
    a value of the wrong type raise a ValueError naming the key."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON/YAML object (of sections, or of settings)")
    raw: dict[str, dict] = {}
    if any(isinstance(obj.get(k), dict) for k in SECTION_CLASSES):  # sectioned
        record = "command" in obj
        for key, values in obj.items():
            if key in SECTION_CLASSES:
                if key == "model" and isinstance(values, str):  # a config.json written before sections
                    values = {"model": values, **({"dtype": obj["dtype"]} if "dtype" in obj else {})}
                if not isinstance(values, dict):
                    raise ValueError(f"section {key!r} must be an object of settings, not {values!r}")
                raw[key] = values
            elif record:  # what loca recorded beside the sections: not settings
                continue
            elif section_of(key):
                raise ValueError(
                    f"{key!r} is a {section_of(key)} setting outside its section: put it under "
                    f"{section_of(key)!r}, or write every setting at the top level (no sections)"
                )
            else:
                raise ValueError(f"unknown section {key!r} (the sections are {', '.join(SECTION_CLASSES)})")
    else:  # flat
        for key, value in obj.items():
            section = section_of(key)
            if key in SECTION_CLASSES and section is None:
                raise ValueError(f"section {key!r} must be an object of settings, not {value!r}")
            if section is None:
                raise ValueError(
                    f"unknown setting {key!r} (not a field of the model, data or loca section; "
                    "see `loca fit --help`)"
                )
            raw.setdefault(section, {})[key] = value
    out: dict[str, dict] = {}
    for name, values in raw.items():
        cls = SECTION_CLASSES[name]
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown {'LoCA' if name == 'loca' else name} setting(s) {unknown}")
        out[name] = {k: value_from_file(cls, k, v, where=f"{name}.{k}") for k, v in values.items()}
    return out


def value_from_file(cls, name: str, value, where: str | None = None):
    """A field's value read from a JSON/YAML file, converted as its command-line flag would be:
    a bool from true/false (or the strings "true"/"false"), an int from an integer (or a string
    of one), a float from a number (or a string of one: YAML reads ``1e-3`` as a string), a list
    from a list, a comma-separated string or one scalar (``etas: 0.01`` is ``[0.01]``), None only
    where the field allows it. Anything else raises a ValueError naming ``where`` (the key)."""
    where = where or name
    kind = field_types(cls)[name]
    if value is None:
        if accepts_none(cls, name):
            return None
        raise ValueError(f"{where} must be set (null is not allowed here)")
    if get_origin(kind) is list:
        element = get_args(kind)[0]
        if isinstance(value, str):
            value = [x.strip() for x in value.split(",") if x.strip()]
        elif not isinstance(value, list):
            value = [value]
        return [_scalar_from_file(element, x, where) for x in value]
    return _scalar_from_file(kind, value, where)


def _scalar_from_file(kind, value, where: str):
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ValueError(f"{where} must be true or false, not {value!r}")
    if kind in (int, float):
        if isinstance(value, bool):  # bool is an int in Python, never a count or a size here
            raise ValueError(f"{where} must be {_A[kind]}, not {value!r}")
        if isinstance(value, int) or (kind is float and isinstance(value, float)):
            return kind(value)
        if isinstance(value, str):
            try:
                return kind(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where} must be {_A[kind]}, not {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where} must be a string, not {value!r}")
    return value


_A = {int: "an integer", float: "a number"}
