"""The methods LoCA is compared with: LoRA (PEFT), Adapter-BP (LoCA's adapters by backprop),
Adapter-MeZO and full MeZO."""

from .adapter_bp import AdapterBpRun, AdapterBpSettings, fit_adapter_bp
from .common import HeldoutSelector, MethodResult, completion_loss
from .lora import LoraRun, LoraSettings, fit_lora
from .mezo import MezoRun, MezoSettings, fit_adapter_mezo, fit_mezo

__all__ = [
    "AdapterBpRun",
    "AdapterBpSettings",
    "HeldoutSelector",
    "LoraRun",
    "LoraSettings",
    "MethodResult",
    "MezoRun",
    "MezoSettings",
    "completion_loss",
    "fit_adapter_bp",
    "fit_adapter_mezo",
    "fit_lora",
    "fit_mezo",
]
