"""LoCA: forward-only tuning of a frozen Hugging Face language model after one calibration pass.

Typical use::

    from loca import DataConfig, LocaConfig, ModelConfig, Pipeline
    run = Pipeline(ModelConfig("smollm2-135m-instruct"), DataConfig("sst2", data_dir="data"), LocaConfig())
    results = run.run("runs/sst2")  # Stage I, Stage II (forward passes only), test metrics, run folder

    import loca  # later, on a plain Hugging Face model
    adapters = loca.from_pretrained(model, "runs/sst2/adapter")  # attached; adapters.unload() removes
    model, tokenizer, adapters = loca.load_adapted("runs/sst2/adapter")  # or base + adapter in one call

The building blocks: :class:`Calibrator` (Stage I), :func:`fit` (Stage II), :mod:`loca.eval.evaluation`.
"""

from .config import DataConfig, LocaConfig, ModelConfig
from .core.head import LogitTransform, head_loss_and_error
from .core.ridge import NonFiniteStatisticsError
from .method.adapters import ResidualAdapters, from_pretrained, load_adapted
from .method.artefacts import CheckpointMismatchError
from .method.calibrate import Calibrator, calibrate
from .method.fit import FitResult, fit
from .method.maps import FeedbackMaps
from .method.probe import select_probe
from .method.state import FitState
from .models.parts import ModelParts, UnsupportedModelError, find_parts, fingerprint, load_model
from .pipeline import Pipeline

__version__ = "0.1.0"

__all__ = [
    "Calibrator",
    "CheckpointMismatchError",
    "DataConfig",
    "FeedbackMaps",
    "FitResult",
    "FitState",
    "LocaConfig",
    "LogitTransform",
    "ModelConfig",
    "ModelParts",
    "NonFiniteStatisticsError",
    "Pipeline",
    "ResidualAdapters",
    "UnsupportedModelError",
    "calibrate",
    "find_parts",
    "fingerprint",
    "fit",
    "from_pretrained",
    "head_loss_and_error",
    "load_adapted",
    "load_model",
    "select_probe",
]
