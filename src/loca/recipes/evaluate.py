"""Evaluate a model, frozen or with saved LoCA adapters, on a task's test set.

Prints the mean per-token CE over the gold completion tokens (with and without EOS), the ranking
accuracies acc and acc_norm, and the batches' padding fraction; writes them, the exact test ids
and the settings to ``OUT/results.json`` (atomically). Example::

    loca evaluate --model smollm2-135m-instruct --task arc_easy --n-test 200 --out runs/eval

The test set is drawn as in ``loca fit`` (same task, ``--n-test`` and ``--seed`` give the same
examples), so a fit's adapter can be evaluated again with ``--adapter RUN/adapter``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..config import LocaConfig
from ..data import Splits, degenerate_warnings, get_task, load_test
from ..evaluation import evaluate
from ..io import atomic_write_json
from ..models import fingerprint
from ..runs import prepare_run_dir, require_finite, undefined_as_none
from ..versions import versions
from .common import add_model_args, fit_to_context, resolve_data_dir, setup_model, warn

_DEFAULTS = LocaConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--task", required=True,
                   help="task name (see `loca tasks`) or a JSON Lines file (needs --template)")
    g.add_argument("--template", default=None,
                   help="prompt template with {question} and optionally {passage}")
    g.add_argument("--data-dir", default=None,
                   help="folder of task folders in loca's JSON Lines schema (default: "
                        "$LOCA_DATA_DIR, else the HF hub)")
    g.add_argument("--n-test", type=int, default=0,
                   help="test examples, a seeded sample (0: the whole test split)")
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed,
                   help="seed of the test sample (use the fit's seed to get its test set)")
    g = p.add_argument_group("evaluation")
    g.add_argument("--adapter", default=None,
                   help="folder of saved LoCA adapters (from `loca fit`) to attach")
    g.add_argument("--max-length", type=int, default=_DEFAULTS.max_length,
                   help=f"maximum tokens per sequence (default {_DEFAULTS.max_length}); "
                        "prompts are truncated from the left")
    g.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size,
                   help=f"sequences per forward batch (default {_DEFAULTS.batch_size})")
    g.add_argument("--add-eos", default=None, action=argparse.BooleanOptionalAction,
                   help="count EOS after the answer in test_ce (default: the task's setting)")
    g.add_argument("--out", required=True, help="output folder; receives results.json")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an earlier `loca evaluate` run's results in --out")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.max_length < 2 or args.batch_size < 1:
        raise ValueError("--max-length must be at least 2 and --batch-size at least 1")
    prepare_run_dir(
        args.out, "evaluate", model=args.model, overwrite=args.overwrite, writes=("results.json",)
    )
    task = get_task(args.task, template=args.template)
    data_dir = resolve_data_dir(args.data_dir)
    examples, record = load_test(task, n_test=args.n_test, seed=args.seed, data_dir=data_dir)
    add_eos = task.add_eos if args.add_eos is None else args.add_eos
    model, tokenizer, parts = setup_model(args)
    args.max_length = fit_to_context(args.max_length, model)
    probe = Splits(train=[], heldout=[], test=examples)
    for message in degenerate_warnings(probe):
        warn(f"task {task.name!r}: {message}")
    adapters = None
    if args.adapter:
        from ..adapters import ResidualAdapters

        adapters = ResidualAdapters.from_pretrained(parts, args.adapter).attach()
    try:
        t0 = time.perf_counter()
        metrics = evaluate(parts, tokenizer, task, examples, max_length=args.max_length,
                           batch_size=args.batch_size, add_eos=add_eos, progress=not args.quiet)
        eval_s = time.perf_counter() - t0
    finally:
        if adapters is not None:
            adapters.detach()
    results = {
        **undefined_as_none(metrics),  # test_ce, test_ce_no_eos, acc, acc_norm, n_test, ... at the top level
        "command": "evaluate",
        "model": args.model,
        "dtype": args.dtype,
        "device": str(parts.device),
        "adapter": args.adapter,
        "adapter_norm": None if adapters is None else adapters.norm(),
        "task": task.describe(),
        "data_dir": data_dir,
        "settings": {"max_length": args.max_length, "batch_size": args.batch_size,
                     "add_eos": add_eos, "n_test": args.n_test, "seed": args.seed},
        "test_set": record,
        "fingerprint": fingerprint(parts),
        "versions": versions(),
        "eval_wall_time_s": eval_s,
        "wall_time_s": time.perf_counter() - start,
    }
    print(format_metrics(task.name, args.model, metrics, adapter=args.adapter))
    if metrics["n_truncated"]:
        warn(f"{metrics['n_truncated']} of {metrics['n_test']} prompts were cut from the left to fit "
             f"--max-length {args.max_length}; their question may be lost")  # fmt: skip
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
