"""The methods LoCA is compared with: LoRA (PEFT), Adapter-MeZO and full MeZO."""

from .common import HeldoutSelector, MethodResult, completion_loss
from .lora import LoraRun, LoraSettings, fit_lora
from .mezo import MezoRun, MezoSettings, fit_adapter_mezo, fit_mezo

__all__ = [
    "HeldoutSelector", "LoraRun", "LoraSettings", "MethodResult", "MezoRun", "MezoSettings",
    "completion_loss", "fit_adapter_mezo", "fit_lora", "fit_mezo",
]  # fmt: skip
