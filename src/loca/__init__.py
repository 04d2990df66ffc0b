"""LoCA: forward-only tuning of a frozen Hugging Face language model after one calibration pass.

Typical use::

    from loca import Calibrator, LocaConfig, find_parts, fit
    parts, cfg = find_parts(model), LocaConfig()
    maps = Calibrator(parts, train_items, heldout_items, cfg, pad_id).calibrate()  # Stage I
    result = fit(parts, maps, train_batches, heldout_batches, cfg)  # Stage II: forward passes only
    result.adapters.save_pretrained("adapter/")
"""

from .adapters import CheckpointMismatchError, ResidualAdapters
from .calibrate import Calibrator, FeedbackMaps, calibrate, select_probe
from .config import LocaConfig
from .fit import FitResult, fit
from .head import LogitTransform, head_loss_and_error
from .models import ModelParts, UnsupportedModelError, find_parts, fingerprint, load_model
from .ridge import NonFiniteStatisticsError

__version__ = "0.1.0"

__all__ = [
    "Calibrator",
    "CheckpointMismatchError",
    "FeedbackMaps",
    "FitResult",
    "LocaConfig",
    "LogitTransform",
    "ModelParts",
    "NonFiniteStatisticsError",
    "ResidualAdapters",
    "UnsupportedModelError",
    "calibrate",
    "find_parts",
    "fingerprint",
    "fit",
    "head_loss_and_error",
    "load_model",
    "select_probe",
]
