"""List the built-in tasks, or show one task's template and a rendered example.

``loca tasks`` prints the registry; ``loca tasks --show arc_easy`` prints the template, the data
sources, the split policy and one example rendered as prompt + completions (the first item of
the local validation split when local data is found, else a built-in sample item). A user task
is shown with ``loca tasks --show my.jsonl --template 'Q: {question}\\nA:'``.
"""

from __future__ import annotations

import argparse

from ..data import TASKS, get_task
from ..data.sources import describe_source, has_split, load_task_split, resolve_data_dir, source_kind
from ..data.splits import PARTITION_SEED, PARTITION_TEST_FRACTION


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--show",
        metavar="NAME",
        default=None,
        help="show one task (a registry name, or a JSON Lines file with --template)",
    )
    p.add_argument("--template", default=None, help="prompt template to show instead")
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder of task folders (default: $LOCA_DATA_DIR, else the HF hub); used for "
        "the example and the split policy",
    )


def _one_line(template: str) -> str:
    return template.replace("\n", "\\n")


def run(args: argparse.Namespace) -> int:
    if args.show is None:
        print(f"{'task':14} {'hub':34} template")
        for t in TASKS.values():
            print(f"{t.name:14} {str(t.hub):34} {_one_line(t.template)}")
        print(
            "\nuser tasks: a JSON Lines file in loca's task schema with --template "
            "'...{question}...' (see docs/tasks.md); `loca tasks --show NAME` for details"
        )
        return 0
    task = get_task(args.show, template=args.template)
    data_dir = resolve_data_dir(args.data_dir)
    print(f"task        {task.name}")
    print(f"description {task.description}")
    print(f"local       {task.path or (task.folder and f'<data dir>/{task.folder}/<split>.jsonl')}")
    print(f"hub         {task.hub or '-'}")
    print(f"add_eos     {task.add_eos}")
    source = describe_source(task, data_dir)
    print(f"source now  {source}")
    if has_split(task, task.train_split, data_dir):
        policy = f"train pool = split {task.train_split!r}; test = split {task.validation_split!r}"
    else:
        policy = (
            f"no train split at this source: split {task.validation_split!r} is "
            f"partitioned (seed {PARTITION_SEED}) into a train pool and a test part "
            f"({PARTITION_TEST_FRACTION:.0%})"
        )
    print(f"splits      {policy}")
    print("\ntemplate:")
    print(_indent(task.template))
    ex, origin = task.sample, "built-in sample item"
    if source_kind(task, data_dir) == "local":
        ex, origin = (
            load_task_split(task, task.validation_split, data_dir)[0],
            (f"first item of split {task.validation_split!r}"),
        )
    if ex is None:
        return 0
    print(f"\nexample ({origin}, id {ex.id!r}):")
    print("prompt:")
    print(_indent(task.prompt(ex)))
    print("completions:")
    for c in range(len(ex.choices)):
        mark = "*" if c == ex.label else " "
        print(f"  {mark} {task.completion(ex, c)!r}")
    print("(* = gold; the gold completion is followed by EOS when training)")
    return 0


def _indent(text: str) -> str:
    return "\n".join("  | " + line for line in text.split("\n"))
