"""Configuration of a LoCA run, in sections: :class:`ModelConfig` (which model, where),
:class:`DataConfig` (which task, how many examples) and :class:`LocaConfig` (the method: its
calibration, fit and shared fields, each field tagged with its section). The Python API takes
these objects, the CLI flags are generated from them, and a run's ``config.json`` stores them
under ``model``, ``data`` and ``loca``: one name per quantity everywhere."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Self

# The sections of LocaConfig's fields, in the order the CLI shows them.
SECTIONS = {
    "calibration": "Stage I: the feedback maps",
    "fit": "Stage II: the forward-only fit and its selection",
    "shared": "sequences, batches and seed (every stage)",
}


def option(default, help: str, **kw):
    """A dataclass field with its help text (the CLI flag's help) and, for LocaConfig, its
    ``section``; lists get a default factory."""
    if isinstance(default, list | tuple):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


class Settings:
    """What the settings dataclasses share (LoCA's and the baselines'): the dict round trip that a
    run's configuration files use, and one error naming every invalid field."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Self:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
        return cls(**d)

    def refuse_invalid(self, checks: dict[str, bool]) -> None:
        """Raise a ValueError naming (with its value) every field whose check is False."""
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"invalid {type(self).__name__} values: {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}"
            )


@dataclass
class LocaConfig(Settings):
    """Hyper-parameters of calibration (Stage I) and forward-only fitting (Stage II)."""

    rank: int = option(32, "adapter rank r (A is r×d, fixed; B is d×r, fitted)", section="fit")
    feedback_rank: int = option(32, "rank k of each block's feedback map F_l", section="calibration")
    beta_rel: float = option(
        1.0, "relative ridge of the feedback fit: β = β_rel·trace(EᵀE)/d", section="calibration"
    )
    feedback_gate: str = option(
        "none",
        "which map a predict position's head error goes through: 'none' = one map per block (the "
        "paper); 'role' = one map per block and position role (the prompt's last position, inside "
        "the completion, the position predicting EOS), each fitted on its role's probe rows",
        section="calibration",
        choices=("none", "role"),
    )
    lam_rel: list[float] = option(
        [1e-3], "relative ridge candidates of the adapter solve: λ = λ_rel·trace(G)/r",
        section="fit",
    )
    ridge_center: str = option(
        "zero",
        "what the adapter solve's ridge pulls B' towards: 'zero' (the paper; λ||B'||² also "
        "shrinks B every iteration) or 'previous' (λ||B' − B||²: a damped step, no shrinkage)",
        section="fit",
        choices=("zero", "previous"),
    )
    etas: list[float] = option(
        [0.003, 0.01, 0.03],
        "dimensionless step sizes η: fixed control runs one trajectory per value; adaptive control "
        "starts at the first",
        section="fit",
    )
    step_scale: str = option(
        "rms",
        "target step: 'rms' = η relative to the residual stream (η·RMS(h)/RMS(F e) per block and "
        "batch); 'absolute' = η as an absolute step (the paper's unnormalised ablation)",
        section="fit",
        choices=("rms", "absolute"),
    )
    step_control: str = option(
        "adaptive",
        "'fixed' = one trajectory per η candidate, each at its fixed η (the paper); 'adaptive' = one "
        "trajectory that starts at the first η, grows η by eta_grow after every step that lowers "
        "the held-out CE and, after a step that does not, restores B and retries with η·eta_shrink "
        "on the same training statistics (no new training pass)",
        section="fit",
        choices=("fixed", "adaptive"),
    )
    eta_grow: float = option(1.5, "adaptive control: η factor after an accepted step (≥ 1)", section="fit")
    eta_shrink: float = option(0.5, "adaptive control: η factor after a rejected step (< 1)", section="fit")
    a_init: str = option(
        "random",
        "the fixed down-projection A: 'random' = N(0, 1/d) from (seed, block); 'principal' = the "
        "top-r principal directions of each block's input at the predict positions (one extra "
        "forward pass over the training data, streamed as a Nyström sketch)",
        section="fit",
        choices=("random", "principal"),
    )
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
        3, "stop a trajectory after this many iterations (adaptive: tries) without held-out improvement",
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

    def __post_init__(self) -> None:
        self.lam_rel = [float(x) for x in self.lam_rel]
        self.etas = [float(x) for x in self.etas]
        ok = math.isfinite
        checks = {
            "rank": self.rank >= 1,
            "feedback_rank": self.feedback_rank >= 1,
            "beta_rel": self.beta_rel > 0 and ok(self.beta_rel),
            "feedback_gate": self.feedback_gate in ("none", "role"),
            "lam_rel": bool(self.lam_rel) and all(x > 0 and ok(x) for x in self.lam_rel),
            "etas": bool(self.etas) and all(x > 0 and ok(x) for x in self.etas),
            "step_scale": self.step_scale in ("rms", "absolute"),
            "ridge_center": self.ridge_center in ("zero", "previous"),
            "step_control": self.step_control in ("fixed", "adaptive"),
            "eta_grow": 1 <= self.eta_grow < math.inf,
            "eta_shrink": 0 < self.eta_shrink < 1,
            "a_init": self.a_init in ("random", "principal"),
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
            "probe_memory_mb": self.probe_memory_mb >= 0 and ok(self.probe_memory_mb),
            "batch_size": self.batch_size >= 1,
            "max_length": self.max_length >= 2,
        }
        self.refuse_invalid(checks)

    @classmethod
    def preset(cls, name: str, **overrides) -> LocaConfig:
        """A named configuration (see :data:`PRESETS`) with ``overrides`` on top."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Named configurations. "paper" is the method as the paper states it (random A, fixed-η
# trajectories, one calibration); it stays reproducible whatever the defaults become.
PRESETS: dict[str, dict] = {
    "paper": dict(
        rank=32, feedback_rank=8, beta_rel=1e-3, feedback_gate="none", lam_rel=[1e-3], ridge_center="zero",
        etas=[0.003, 0.01, 0.03],
        step_scale="rms", step_control="fixed", a_init="random", recalibrate_every=0, calibration_rounds=1,
        probe_synthetic=0,
        max_iters=40, patience=3, groups=1, probe_positions=1000,
    ),  # fmt: skip
    "default": {},
}


DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Which model to load, where and how."""

    model: str = option(
        DEFAULT_MODEL,
        "local folder, hub id, offline alias (smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct), "
        "or arch:NAME, a published architecture with random weights (arch:qwen2.5-7b, see loca.archs)",
    )
    device: str = option("auto", "cpu, cuda, cuda:1, ... (auto: cuda if available)")
    dtype: str = option("float32", "backbone dtype (adapters and statistics stay float32/float64)",
                        choices=DTYPES)  # fmt: skip
    trust_remote_code: bool = option(
        False, "allow running Python code shipped with the model (auto_map); off by default"
    )
    random_init: bool = option(
        False, "random weights from the model's config and tokenizer (for time/memory measurements)"
    )
    device_map: str | None = option(
        None,
        "spread the model's blocks over the GPUs through accelerate, for a model larger than one "
        "device: auto, balanced or sequential (replaces --device)",
        choices=("auto", "balanced", "sequential"),
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"invalid ModelConfig dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if not self.model:
            raise ValueError("ModelConfig.model is empty")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DataConfig:
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

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)!r}" for k in ("n_train", "n_heldout", "n_test")
               if not isinstance(getattr(self, k), int) or getattr(self, k) < 0]  # fmt: skip
        if bad:
            raise ValueError(f"invalid DataConfig values: {', '.join(bad)} (counts must be integers ≥ 0)")

    def to_dict(self) -> dict:
        return asdict(self)


def sections_from_dict(obj: dict) -> dict:
    """The sections a JSON/YAML object holds, as dicts of fields: a run's ``config.json``
    (``{"model": {...}, "data": {...}, "loca": {...}}``), a bare LocaConfig object, or an older
    run's config (``"model"`` a name string, ``"dtype"`` beside it). Unknown fields raise."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON/YAML object")
    known = {"model": ModelConfig, "data": DataConfig, "loca": LocaConfig}
    if not any(k in obj for k in known):
        obj = {"loca": obj}
    out: dict[str, dict] = {}
    for name, cls in known.items():
        values = obj.get(name)
        if values is None:
            continue
        if name == "model" and isinstance(values, str):  # a config.json written before sections
            values = {"model": values, **({"dtype": obj["dtype"]} if "dtype" in obj else {})}
        if not isinstance(values, dict):
            raise ValueError(f"section {name!r} must be an object")
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown {'LoCA' if name == 'loca' else name} setting(s) {unknown}")
        out[name] = values
    return out
