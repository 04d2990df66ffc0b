"""The methods LoCA is compared with: LoRA (PEFT), Adapter-MeZO and full MeZO."""

from .common import HeldoutSelector, MethodResult, completion_loss
from .lora import LoraRun, LoraSettings, fit_lora

__all__ = ["HeldoutSelector", "LoraRun", "LoraSettings", "MethodResult", "completion_loss", "fit_lora"]
