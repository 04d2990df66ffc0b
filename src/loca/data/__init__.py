"""Tasks, data sources, splits, tokenisation and batching."""

from .batching import Batch, Encoded, TruncationError, encode, make_batches, padding_fraction
from .encoding import encode_choices, encode_examples
from .schema import Example
from .sources import (
    DataError,
    DataNotFoundError,
    hub_row_to_example,
    load_local,
    load_task_split,
)
from .splits import Splits, content_sha256, degenerate_warnings, load_splits, load_test
from .tasks import TASKS, Grouping, HubSpec, Task, TemplateError, get_task

__all__ = [
    "TASKS",
    "Batch",
    "DataError",
    "DataNotFoundError",
    "Encoded",
    "Example",
    "Grouping",
    "HubSpec",
    "Splits",
    "Task",
    "TemplateError",
    "TruncationError",
    "content_sha256",
    "encode",
    "encode_choices",
    "encode_examples",
    "get_task",
    "hub_row_to_example",
    "load_local",
    "degenerate_warnings",
    "load_splits",
    "load_task_split",
    "load_test",
    "make_batches",
    "padding_fraction",
]
