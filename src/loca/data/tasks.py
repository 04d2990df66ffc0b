"""Tasks as data, one :class:`Task` record each in :data:`TASKS` (like lm-evaluation-harness's task
YAMLs): the prompt template, where the items come from (the local folder and split files, the hub
dataset and splits with the pure function that maps a hub row to an item), which splits play which
role, and which items must stay together in a partition (the grouping).

Every task is a multiple-choice item ``{question, passage?, choices[], label}`` (see
:class:`~loca.data.schema.Example`). The prompt is the task's template with ``{question}`` and
(optionally) ``{passage}`` filled in; the completion is ``" " + choices[label]``.

Whitespace: ``question``, ``passage`` and the choice text are stripped of leading and trailing
whitespace when a prompt or completion is rendered (GLUE's SST-2 sentences end in a space, for
example). Inner whitespace is kept exactly as in the data (SST-2 stays in its tokenised form,
``"it 's a charming ..."``). The examples themselves are never modified, so ids and raw text can
always be checked against the source.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from .schema import Example

PLACEHOLDERS = ("question", "passage")


class TemplateError(ValueError):
    """A template is malformed or uses placeholders other than ``{question}``, ``{passage}``."""


def template_fields(template: str) -> list[str]:
    """The placeholder names used in ``template`` (``{{``/``}}`` are literal braces)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:  # e.g. a single "{" or "}"
        raise TemplateError(f"malformed template {template!r}: {exc}") from None
    names = []
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if spec or conv:
            raise TemplateError(
                f"template {template!r}: placeholder {{{name}}} may not carry a format spec or conversion"
            )
        names.append(name)
    return names


def check_template(template: str) -> str:
    """Validate a template: it needs ``{question}``; ``{passage}`` is the only other placeholder."""
    if not isinstance(template, str) or not template:
        raise TemplateError("the template must be a non-empty string")
    names = template_fields(template)
    unknown = sorted({n for n in names if n not in PLACEHOLDERS})
    if unknown:
        raise TemplateError(
            f"template {template!r} uses unknown placeholder(s) "
            f"{', '.join('{' + n + '}' for n in unknown)}; allowed: {{question}}, {{passage}}"
        )
    if "question" not in names:
        raise TemplateError(f"template {template!r} lacks the {{question}} placeholder")
    return template


# --- grouping: which items must stay on the same side of a partition ----------------------------

#: Sentences shorter than this (in words) are too generic to tie two items together.
GROUP_MIN_WORDS = 5
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"\w+")


def _normalise(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def sentence_keys(text: str, min_words: int = GROUP_MIN_WORDS) -> set[str]:
    """The sentences of ``text`` with ``min_words`` or more words, lower-cased, on word
    characters only (punctuation and spacing ignored): link keys for grouping."""
    keys = map(_normalise, _SENTENCE_END.split(text.strip()))
    return {k for k in keys if len(k.split()) >= min_words}


def text_keys(text: str, min_words: int = GROUP_MIN_WORDS) -> set[str]:
    """:func:`sentence_keys` and the whole normalised text (so identical texts always link)."""
    return (sentence_keys(text, min_words) | {_normalise(text)}) - {""}


def passage_keys(ex: Example) -> set[str]:
    """The same passage: an identical passage, or one sentence in common (a revision of the same
    Wikipedia paragraph). Items without a passage are not linked."""
    return set() if ex.passage is None else text_keys(ex.passage)


def context_keys(ex: Example) -> set[str]:
    """The same source of a continuation item (HellaSwag: one video or WikiHow article): a
    sentence in common between the contexts, or one context holding the sentence that another
    item's gold ending completes (the next window of the same video or article)."""
    sentences = _SENTENCE_END.split(ex.question.strip())
    completed = sentences[-1] + " " + ex.choices[ex.label].strip()
    return text_keys(ex.question) | sentence_keys(completed)


@dataclass(frozen=True)
class Grouping:
    """Which items must stay on the same side of a partition: ``keys`` maps an item to link keys;
    items sharing a key, directly or through other items, form one group (see
    :func:`loca.data.splits.group_ids`). ``name`` is what split records store."""

    name: str
    keys: Callable[[Example], set[str]]


PASSAGE = Grouping("passage", passage_keys)
CONTEXT = Grouping("context", context_keys)
#: The groupings a task's ``group_by`` may name.
GROUPINGS: dict[str, Grouping] = {g.name: g for g in (PASSAGE, CONTEXT)}


@dataclass(frozen=True)
class HubSpec:
    """Where a task lives on the Hugging Face hub (``datasets.load_dataset(path, name)``), which hub
    splits serve as the task's train and validation splits (``train_split=None``: none), and how one
    hub row becomes an :class:`Example`: ``to_example(row, split, index)``, a pure function, where
    ``split`` is the *local* split name and ``index`` the row's position in its split (both only
    build ids for sources without their own: ``<task>-<split>-<index>``, as in ``shared/data``)."""

    path: str
    name: str | None = None
    to_example: Callable[[Mapping, str, int], Example] = field(kw_only=True)
    train_split: str | None = "train"
    validation_split: str = "validation"

    def __str__(self) -> str:
        return f"{self.path}" + (f" ({self.name})" if self.name else "")


@dataclass(frozen=True)
class Task:
    """A task as data. See ``docs/tasks.md`` for the registry's choices and their reasons.

    ``folder`` is the task's folder under a data directory (``<data_dir>/<folder>/<split>.jsonl``);
    ``train_split``/``validation_split`` name the local files that serve as the train pool and
    the official validation split (the test set); ``hub`` says the same for the hub and how its
    rows map to items. ``train_split=None`` means there is no train split: the validation split is
    partitioned (see :mod:`loca.data.splits`). ``path`` is set for user tasks: a JSON Lines file
    (its only split, used as validation) or a folder of ``<split>.jsonl`` files. ``group_by`` is
    the task's :class:`Grouping` (or the name of one in :data:`GROUPINGS`): items of one group
    (the same passage, the same source video) are never split between the test part and the train
    pool, nor between train and held-out.
    """

    name: str
    template: str
    description: str = ""
    folder: str | None = None
    hub: HubSpec | None = None
    train_split: str | None = "train"
    validation_split: str = "validation"
    add_eos: bool = True
    path: str | None = None
    sample: Example | None = None  # a fixed item for ``loca tasks --show`` and the docs
    group_by: Grouping | str | None = None  # a name: the Grouping of that name in GROUPINGS

    def __post_init__(self) -> None:
        check_template(self.template)
        if isinstance(self.group_by, str):
            if self.group_by not in GROUPINGS:
                raise ValueError(
                    f"task {self.name!r}: unknown group_by {self.group_by!r}; known: {', '.join(GROUPINGS)}"
                )
            object.__setattr__(self, "group_by", GROUPINGS[self.group_by])

    @property
    def group_name(self) -> str | None:
        """The grouping's name (what split records store), None when ungrouped."""
        return None if self.group_by is None else self.group_by.name

    @property
    def uses_passage(self) -> bool:
        return "passage" in template_fields(self.template)

    def prompt(self, ex: Example) -> str:
        """The rendered prompt (fields stripped of surrounding whitespace)."""
        fields = {"question": ex.question.strip()}
        if self.uses_passage:
            if ex.passage is None:
                raise ValueError(
                    f"task {self.name!r}: the template uses {{passage}} but example {ex.id!r} has no passage"
                )
            fields["passage"] = ex.passage.strip()
        return self.template.format(**fields)

    def completion(self, ex: Example, choice: int | None = None) -> str:
        """``" " + choices[choice]`` (the gold choice when ``choice`` is None), stripped."""
        idx = ex.label if choice is None else choice
        if not 0 <= idx < len(ex.choices):
            raise IndexError(f"choice {idx} out of range for example {ex.id!r} ({len(ex.choices)} choices)")
        return " " + ex.choices[idx].strip()

    def with_template(self, template: str) -> Task:
        return replace(self, template=check_template(template))

    def describe(self) -> dict:
        """A JSON-friendly description (for ``results.json`` and ``loca tasks``)."""
        return {
            "name": self.name,
            "template": self.template,
            "description": self.description,
            "folder": self.folder,
            "hub": None if self.hub is None else {"path": self.hub.path, "name": self.hub.name},
            "train_split": self.train_split,
            "validation_split": self.validation_split,
            "add_eos": self.add_eos,
            "path": self.path,
            "group_by": self.group_name,
        }


# --- hub rows -> Example (pure functions) ----------------------------------------------------


def hellaswag_clean(text: str) -> str:
    """Remove WikiHow markup exactly as the llama.cpp dump behind ``shared/data/hellaswag`` did.

    ``[header]``, ``[step]``, ``[substeps]`` are dropped, ``" [title]"`` becomes ``". "`` (other
    ``[title]`` forms are dropped), double spaces become single (one pass) and one leading and one
    trailing space are removed. Unlike the lm-evaluation-harness, other bracketed text is kept.
    """
    for old, new in (
        ("[header]", ""),
        ("[step]", ""),
        ("[substeps]", ""),
        (" [title]", ". "),
        ("[title] ", ""),
        ("[title].", ""),
        ("  ", " "),
    ):
        text = text.replace(old, new)
    if text.startswith(" "):
        text = text[1:]
    if text.endswith(" "):
        text = text[:-1]
    return text


def _lettered(row: Mapping) -> tuple[tuple[str, ...], int]:
    texts, keys = list(row["choices"]["text"]), list(row["choices"]["label"])
    if row["answerKey"] not in keys:
        raise ValueError(f"answerKey {row['answerKey']!r} is not one of the choice labels {keys}")
    return tuple(texts), keys.index(row["answerKey"])


def _sst2(row: Mapping, split: str, index: int) -> Example:
    idx = row.get("idx", index)
    return Example(
        question=row["sentence"],
        choices=("negative", "positive"),
        label=int(row["label"]),
        id=f"sst2-{split}-{idx}",
    )


def _boolq(row: Mapping, split: str, index: int) -> Example:
    return Example(
        question=row["question"],
        passage=row["passage"],
        choices=("no", "yes"),
        label=int(bool(row["answer"])),
        id=f"boolq-{split}-{index}",
    )


def _arc(row: Mapping, split: str, index: int) -> Example:
    choices, label = _lettered(row)
    return Example(question=row["question"], choices=choices, label=label, id=row["id"])


def _obqa(row: Mapping, split: str, index: int) -> Example:
    choices, label = _lettered(row)
    return Example(question=row["question_stem"], choices=choices, label=label, id=row["id"])


def _hellaswag(row: Mapping, split: str, index: int) -> Example:
    if row["label"] in ("", None):
        raise ValueError("unlabelled row (the HellaSwag test split has no labels)")
    return Example(
        question=hellaswag_clean(row["ctx"]),
        choices=tuple(hellaswag_clean(e) for e in row["endings"]),
        label=int(row["label"]),
        id=f"hellaswag-{split}-{index}",
    )


_ARC_TEMPLATE = "Question: {question}\nAnswer:"

TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task(
            name="sst2",
            template="Review: {question}\nSentiment (positive or negative):",
            description="GLUE SST-2 movie-review sentiment; choices negative/positive",
            folder="sst2",
            hub=HubSpec("nyu-mll/glue", "sst2", to_example=_sst2),
            sample=Example(
                question="it 's a charming and often affecting journey . ",
                choices=("negative", "positive"),
                label=1,
                id="sst2-validation-0",
            ),
        ),
        Task(
            name="boolq",
            template="{passage}\nQuestion: {question}?\nAnswer:",
            description="BoolQ yes/no questions about a Wikipedia passage; choices no/yes "
            "(no train split offline: validation is partitioned)",
            folder="boolq",
            hub=HubSpec("google/boolq", to_example=_boolq),
            group_by=PASSAGE,
            sample=Example(
                question="is windows movie maker part of windows essentials",
                passage="Windows Movie Maker is a discontinued video editing program by Microsoft.",
                choices=("no", "yes"),
                label=1,
                id="boolq-sample",
            ),
        ),
        Task(
            name="arc_easy",
            template=_ARC_TEMPLATE,
            description="AI2 Reasoning Challenge, Easy set; 3-5 answer texts",
            folder="arc_easy",
            hub=HubSpec("allenai/ai2_arc", "ARC-Easy", to_example=_arc),
            sample=Example(
                question="Which technology was developed most recently?",
                choices=("cellular telephone", "television", "refrigerator", "airplane"),
                label=0,
                id="MCAS_2000_4_6",
            ),
        ),
        Task(
            name="arc_challenge",
            template=_ARC_TEMPLATE,
            description="AI2 Reasoning Challenge, Challenge set; 3-5 answer texts (hub only "
            "unless a local arc_challenge/ folder is supplied)",
            folder="arc_challenge",
            hub=HubSpec("allenai/ai2_arc", "ARC-Challenge", to_example=_arc),
            sample=Example(
                question="Which property of a mineral can be determined just by looking at it?",
                choices=("luster", "mass", "weight", "hardness"),
                label=0,
                id="arc-challenge-sample",
            ),
        ),
        Task(
            name="obqa",
            template="{question}",
            description="OpenBookQA (main): the question stem is continued by one of 4 answers",
            folder="obqa",
            hub=HubSpec("allenai/openbookqa", "main", to_example=_obqa),
            sample=Example(
                question="Gas can fill any container it is given, and liquid",
                choices=(
                    "is standard weight and size",
                    "is the opposite of variable",
                    "only needs a few",
                    "uses what it needs",
                ),
                label=3,
                id="7-57",
            ),
        ),
        Task(
            name="hellaswag",
            template="{question}",
            description="HellaSwag: a context continued by one of 4 endings (no train split "
            "offline: validation is partitioned; WikiHow markup removed)",
            folder="hellaswag",
            hub=HubSpec("Rowan/hellaswag", to_example=_hellaswag),
            group_by=CONTEXT,
            sample=Example(
                question="A man is sitting on a roof. he",
                choices=(
                    "is using wrap to wrap a pair of skis.",
                    "is ripping level tiles off.",
                    "is holding a rubik's cube.",
                    "starts pulling up roofing on a roof.",
                ),
                label=3,
                id="hellaswag-validation-0",
            ),
        ),
    ]
}


def user_task(path: str | Path, template: str, name: str | None = None) -> Task:
    """A task from a user's JSON Lines file (or a folder of ``<split>.jsonl`` files).

    A single file is the task's only split: it is used as the validation split and partitioned
    into a train pool and a test part. A folder is used like a registry task's folder: its
    ``train.jsonl`` (if present) is the train pool and ``validation.jsonl`` the test split.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"user task data {str(p)!r} not found")
    if template is None:
        raise TemplateError(
            f"a user task ({p}) needs a template, e.g. --template 'Question: {{question}}\\nAnswer:'"
        )
    check_template(template)
    if p.is_dir():
        return Task(
            name=name or p.name,
            template=template,
            description=f"user task from folder {p}",
            path=str(p),
        )
    return Task(
        name=name or p.stem,
        template=template,
        description=f"user task from file {p}",
        train_split=None,
        validation_split=p.stem,
        path=str(p),
    )


_ESCAPES = re.compile(r"\\(\\|n|t)")


def unescape_template(template: str) -> str:
    """Read ``\\n`` and ``\\t`` typed as two characters (as on a command line) as newline and
    tab; ``\\\\`` is a literal backslash. Other text is unchanged."""
    return _ESCAPES.sub(lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], template)


def get_task(name: str | Task, template: str | None = None) -> Task:
    """A registry task by name (optionally with another template), or a user task from a path.

    A name that is not in the registry is taken as a path to a JSON Lines file (or folder) in the
    shared data schema, which then requires ``template``. In ``template``, a typed ``\\n`` or
    ``\\t`` means newline or tab (see :func:`unescape_template`).
    """
    if template is not None:
        template = unescape_template(template)
    if isinstance(name, Task):
        return name if template is None else name.with_template(template)
    if name in TASKS:
        task = TASKS[name]
        return task if template is None else task.with_template(template)
    looks_like_path = any(sep in name for sep in ("/", "\\")) or name.endswith((".jsonl", ".json"))
    if Path(name).exists() or looks_like_path:
        return user_task(name, template)
    raise ValueError(
        f"unknown task {name!r}; known tasks: {', '.join(TASKS)} "
        "(or give a path to a JSON Lines file together with a template)"
    )
