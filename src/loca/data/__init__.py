"""Tasks, data sources, splits, tokenisation and batching."""

from .batching import Batch, Encoded, TruncationError, encode, make_batches
from .schema import Example

__all__ = ["Batch", "Encoded", "Example", "TruncationError", "encode", "make_batches"]
