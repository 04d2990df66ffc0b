"""Side-by-side comparison of LoCA with the frozen model, LoRA and MeZO (``loca compare``)."""

from .methods import METHODS
from .runner import CompareSettings, MethodConfigs, run_compare

__all__ = ["METHODS", "CompareSettings", "MethodConfigs", "run_compare"]
