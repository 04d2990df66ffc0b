"""Side-by-side comparison of LoCA with the frozen model, LoRA and MeZO (``loca compare``)."""

from .methods import METHODS, REGISTRY, Method, MethodConfigs
from .runner import CompareSettings, run_compare

__all__ = ["METHODS", "REGISTRY", "CompareSettings", "Method", "MethodConfigs", "run_compare"]
