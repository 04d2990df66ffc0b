"""Configuration of a LoCA run: one dataclass, the single source for API, CLI and saved JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


def option(default, help: str, **kw):
    """A dataclass field with its help text (the CLI flag's help); lists get a default factory."""
    if isinstance(default, list | tuple):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class LocaConfig:
    """Hyper-parameters of calibration (Stage I) and forward-only fitting (Stage II)."""

    rank: int = option(32, "adapter rank r (A is r×d, fixed; B is d×r, fitted)")
    feedback_rank: int = option(8, "rank k of each block's feedback map F_l")
    beta_rel: float = option(1e-3, "relative ridge of the feedback fit: β = β_rel·trace(EᵀE)/d")
    lam_rel: list[float] = option(
        [1e-3], "relative ridge candidates of the adapter solve: λ = λ_rel·trace(G)/r"
    )
    etas: list[float] = option([0.003, 0.01, 0.03], "dimensionless step-size candidates η")
    step_scale: str = option(
        "rms",
        "target step: 'rms' = η relative to the residual stream (η·RMS(h)/RMS(F e) per block and "
        "batch); 'absolute' = η as an absolute step (the paper's unnormalised ablation)",
    )
    max_iters: int = option(40, "maximum number of outer iterations T_max")
    patience: int = option(3, "stop a trajectory after this many iterations without held-out improvement")
    groups: int = option(1, "Gauss–Seidel groups: 1 = Jacobi, num_blocks = full Gauss–Seidel")
    probe_positions: int = option(1000, "minimum number of predict positions in the calibration probe")
    probe_micro_batch: int = option(8, "sequences per probe micro-batch (bounds the probe's peak memory)")
    batch_size: int = option(16, "sequences per forward batch in Stage II and evaluation")
    max_length: int = option(256, "maximum tokens per sequence; prompts are truncated from the left")
    add_eos: bool = option(True, "append EOS to the completion (and train on it)")
    seed: int = option(0, "seed of A, probe sampling and random diagnostics")

    def __post_init__(self) -> None:
        self.lam_rel = [float(x) for x in self.lam_rel]
        self.etas = [float(x) for x in self.etas]
        checks = {
            "rank": self.rank >= 1,
            "feedback_rank": self.feedback_rank >= 1,
            "beta_rel": self.beta_rel > 0,
            "lam_rel": bool(self.lam_rel) and all(x > 0 for x in self.lam_rel),
            "etas": bool(self.etas) and all(x > 0 for x in self.etas),
            "step_scale": self.step_scale in ("rms", "absolute"),
            "max_iters": self.max_iters >= 0,
            "patience": self.patience >= 1,
            "groups": self.groups >= 1,
            "probe_positions": self.probe_positions >= 1,
            "probe_micro_batch": self.probe_micro_batch >= 1,
            "batch_size": self.batch_size >= 1,
            "max_length": self.max_length >= 2,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"invalid LocaConfig values: {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LocaConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown LocaConfig keys: {sorted(unknown)}")
        return cls(**d)
