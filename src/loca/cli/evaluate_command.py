"""Evaluate a model, frozen or with saved LoCA adapters, on a task's test set.

Prints the mean per-token CE over the gold completion tokens (with and without EOS), the ranking
accuracies acc and acc_norm, and the batches' padding fraction; writes them, the exact test ids
and the settings to ``OUT/results.json`` (atomically). Example::

    loca evaluate --model smollm2-135m-instruct --task arc_easy --n-test 200 --out runs/eval

The test set is drawn as in ``loca fit`` (same task, ``--n-test`` and ``--seed`` give the same
examples), so a fit's adapter can be evaluated again with ``--adapter RUN/adapter``: without
``--model`` and ``--task`` the base model, task, template and ``--add-eos`` are those the adapter
records (flags given win; ``--task`` naming another built-in task brings its own template)::

    loca evaluate --adapter runs/sst2/adapter --n-test 200 --out runs/eval
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from pathlib import Path

from ..config import DataConfig, LocaConfig
from ..infra.io import atomic_write_json
from ..infra.runs import prepare_run_dir, require_finite, undefined_as_none
from ..infra.versions import versions
from ..models.parts import fingerprint
from .args import (
    adapter_config,
    add_dataclass_args,
    add_model_args,
    add_output_args,
    data_from_adapter,
    given,
    pipeline_from_args,
    warn,
)

log = logging.getLogger("loca")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_dataclass_args(
        p, DataConfig, title="data", skip=("n_train", "n_heldout"), only_given=True, defaults={"n_test": 0}
    )
    add_dataclass_args(
        p,
        LocaConfig,
        title="evaluation",
        section="shared",
        only_given=True,
        description="--add-eos defaults to the task's setting; --seed draws the test "
        "sample (a fit's seed gives its test set)",
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--adapter",
        default=None,
        help="saved LoCA adapter folder (from `loca fit`) to attach; its recorded base model, task, "
        "template and EOS setting are used unless --model, --task, --template, --add-eos are given",
    )
    g.add_argument("--out", required=True, help="output folder; receives results.json")
    g.add_argument(
        "--overwrite", action="store_true", help="replace an earlier `loca evaluate` run's results in --out"
    )
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    record = adapter_config(args)  # the adapter's base model, task, template and EOS setting
    data_defaults, add_eos = data_from_adapter(args, record) if record else ({}, None)
    pipeline = pipeline_from_args(args, record, n_test=0, **data_defaults)
    if not hasattr(args, "add_eos"):
        pipeline.cfg = replace(pipeline.cfg, add_eos=pipeline.task.add_eos if add_eos is None else add_eos)
    if record is not None:  # say what came from the adapter
        recorded = lambda section, name: "" if given(args, section, name) else " (the adapter's)"  # noqa: E731
        log.info(
            f"base model {pipeline.model_config.model}{recorded('model', 'model')}, task {pipeline.task.name}"
            f"{recorded('data', 'task')}"
        )
    prepare_run_dir(
        args.out,
        "evaluate",
        model=pipeline.model_config.model,
        overwrite=args.overwrite,
        writes=("results.json",),
    )
    examples, record = pipeline.test_set()
    adapters = None
    if args.adapter:
        from ..method.adapters import ResidualAdapters

        adapters = ResidualAdapters.from_pretrained(pipeline.parts, args.adapter)
    t0 = time.perf_counter()
    metrics = pipeline.evaluate(examples, adapters)
    eval_s = time.perf_counter() - t0
    cfg, m = pipeline.cfg, pipeline.model_config
    results = {
        **undefined_as_none(metrics),  # test_ce, test_ce_no_eos, acc, acc_norm, n_test, ... at the top level
        "command": "evaluate",
        "model": m.model,
        "dtype": m.dtype,
        "device": str(pipeline.parts.device),
        "adapter": args.adapter,
        "adapter_norm": None if adapters is None else adapters.norm(),
        "task": pipeline.task.describe(),
        "data_dir": pipeline.data.data_dir,
        "settings": {
            "max_length": cfg.max_length,
            "batch_size": cfg.batch_size,
            "add_eos": cfg.add_eos,
            "n_test": pipeline.data.n_test,
            "seed": cfg.seed,
        },
        "test_set": record,
        "fingerprint": fingerprint(pipeline.parts),
        "versions": versions(),
        "eval_wall_time_s": eval_s,
        "wall_time_s": time.perf_counter() - start,
    }
    print(format_metrics(pipeline.task.name, m.model, metrics, adapter=args.adapter))
    if metrics["n_truncated"]:
        warn(
            f"{metrics['n_truncated']} of {metrics['n_test']} prompts were cut from the left to fit "
            f"--max-length {cfg.max_length}; their question may be lost"
        )
    out = Path(args.out) / "results.json"
    require_finite(metrics, "the evaluation")
    atomic_write_json(out, results)
    print(f"wall time {results['wall_time_s']:.1f} s (evaluation {eval_s:.1f} s); wrote {out}")
    return 0


def format_metrics(task: str, model: str, m: dict, adapter: str | None = None) -> str:
    what = f"{task} on {model}" + (f" + adapter {adapter}" if adapter else " (frozen)")
    lines = [
        what,
        f"  test CE        {m['test_ce']:.4f}   (mean over {m['n_tokens']} completion tokens)",
        f"  test CE no EOS {m['test_ce_no_eos']:.4f}",
        f"  acc            {m['acc']:.4f}",
        f"  acc_norm       {m['acc_norm']:.4f}",
        f"  n_test         {m['n_test']}",
        f"  padding        {m['padding_fraction']:.1%} of batch positions "
        f"({m['n_sequences']} sequences: every choice of every example)",
        f"  truncated      {m['n_truncated']} prompt(s) cut from the left",
    ]
    return "\n".join(lines)
