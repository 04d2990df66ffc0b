"""The methods LoCA is compared with: LoRA (PEFT), Adapter-MeZO and full MeZO."""

from .common import HeldoutSelector, MethodResult, completion_loss

__all__ = ["HeldoutSelector", "MethodResult", "completion_loss"]
