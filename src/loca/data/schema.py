"""The one item schema every task uses: a multiple-choice question."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """``{question, passage?, choices[], label}``; the gold completion is ``" " + choices[label]``."""

    question: str
    choices: tuple[str, ...]
    label: int
    passage: str | None = None
    id: str = ""

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError(f"example {self.id!r} has no choices")
        if not 0 <= self.label < len(self.choices):
            raise ValueError(
                f"example {self.id!r}: label {self.label} out of range for {len(self.choices)} choices"
            )
