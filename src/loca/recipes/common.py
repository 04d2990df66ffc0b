"""Argument groups and set-up steps shared by the recipes."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from ..calibrate import Calibrator
from ..config import PRESETS, LocaConfig
from ..data import (
    Batch,
    Encoded,
    Splits,
    Task,
    degenerate_warnings,
    encode_examples,
    get_task,
    load_splits,
    make_batches,
)  # fmt: skip
from ..data.batching import pad_token_id
from ..data.sources import DATA_DIR_ENV
from ..models import ModelParts, clamp_max_length, find_parts, load_model

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="local folder, hub id, or offline alias (smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct)",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda if available)")
    g.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="backbone dtype (adapters and statistics stay float32/float64)",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow running Python code shipped with the model (auto_map); off by default",
    )
    g.add_argument(
        "--random-init",
        action="store_true",
        help="random weights from the model's config and tokenizer (for time/memory measurements)",
    )


def add_data_args(p: argparse.ArgumentParser, *, n_train: int, n_heldout: int, n_test: int) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--task", default="sst2", help="task name (see `loca tasks`) or a JSON Lines file")
    g.add_argument("--template", default=None, help="prompt template for a JSON Lines task file")
    g.add_argument(
        "--data-dir",
        default=None,
        help="folder of task folders in loca's JSON Lines schema (default: $LOCA_DATA_DIR, else the "
        "HF hub)",
    )
    g.add_argument("--n-train", type=int, default=n_train, help="training examples")
    g.add_argument("--n-heldout", type=int, default=n_heldout, help="held-out examples (selection)")
    g.add_argument("--n-test", type=int, default=n_test, help="test examples (0: the whole test split)")


def resolve_data_dir(arg: str | None) -> str | None:
    """``--data-dir``, else ``$LOCA_DATA_DIR``, else None (the Hugging Face hub): recorded in run
    configs as given. Nothing else is searched."""
    return arg or os.environ.get(DATA_DIR_ENV) or None


def add_dataclass_args(
    p: argparse.ArgumentParser, cls, *, title: str, prefix: str = "", skip: tuple[str, ...] = (),
    only_given: bool = False,
) -> argparse._ArgumentGroup:  # fmt: skip
    """One flag per field of the dataclass ``cls`` (``--{prefix}-{field}``), with its help text and
    default; lists take several values, booleans ``--x/--no-x``. With ``only_given`` a flag left
    out sets nothing (the dataclass or a preset supplies the value)."""
    g = p.add_argument_group(title)
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + (f"{prefix}-" if prefix else "") + f.name.replace("_", "-")
        dest = (f"{prefix.replace('-', '_')}_" if prefix else "") + f.name
        default = f.default if f.default is not MISSING else f.default_factory()
        help_text = f.metadata["help"] + f" (default {default})"
        if only_given:
            default = argparse.SUPPRESS
        kind = _field_type(f)
        if kind is bool:
            g.add_argument(flag, dest=dest, default=default, action=argparse.BooleanOptionalAction,
                           help=f.metadata["help"])
        elif isinstance(kind, list):
            g.add_argument(flag, dest=dest, type=_comma_list(kind[0]), nargs="+", default=default,
                           help=help_text + "; space- or comma-separated")
        else:
            g.add_argument(flag, dest=dest, type=kind, default=default, help=help_text)
    return g


def _comma_list(kind):
    """Parse one command-line word as a comma-separated list (``sst2,boolq`` or ``0,1,2``)."""

    def parse(word: str) -> list:
        return [kind(x) for x in word.split(",") if x]

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def _field_type(f):
    """``bool``, a scalar type, or ``[element type]`` for a list field, from the annotation."""
    ann = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if ann.startswith(f"list[{name}]"):
            return [kind]
        if ann.startswith(name):
            return kind
    raise TypeError(f"no command-line type for field {f.name}: {ann}")


def dataclass_from_args(cls, args: argparse.Namespace, prefix: str = "", build: bool = True, **overrides):
    """Build ``cls`` from the flags :func:`add_dataclass_args` added (missing fields keep defaults);
    ``build=False`` returns the given values as a dict instead."""
    dest = lambda name: (f"{prefix.replace('-', '_')}_" if prefix else "") + name  # noqa: E731
    values = {f.name: getattr(args, dest(f.name)) for f in fields(cls) if hasattr(args, dest(f.name))}
    for name, value in values.items():  # a list flag's words are lists themselves (comma-separated)
        if isinstance(value, list):
            values[name] = [x for v in value for x in (v if isinstance(v, list) else [v])]
    values = {**values, **overrides}
    return cls(**values) if build else values


def add_config_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """``--preset`` and one flag per LocaConfig field (a flag given overrides the preset)."""
    g = add_dataclass_args(p, LocaConfig, title="LoCA hyper-parameters", skip=skip, only_given=True)
    g.add_argument("--preset", default="default", choices=sorted(PRESETS),
                   help="named configuration the flags start from ('paper': the paper's method)")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="LoCA hyper-parameters from a JSON file: a run's config.json (its 'loca' "
                   "section) or a LocaConfig object; applied over --preset, under the flags given")


def config_from_args(args: argparse.Namespace) -> LocaConfig:
    """The run's LocaConfig: the preset, then ``--config FILE``, then the flags given."""
    given = dataclass_from_args(LocaConfig, args, build=False)
    from_file = read_config_file(args.config) if getattr(args, "config", None) else {}
    return LocaConfig.preset(args.preset, **{**from_file, **given})


def read_config_file(path: str) -> dict:
    """The LocaConfig fields held by a JSON file (a run's ``config.json`` or a bare object)."""
    import json

    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--config {path}: not readable JSON ({exc})") from None
    values = obj.get("loca", obj) if isinstance(obj, dict) else None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a JSON object of LoCA settings")
    unknown = sorted(set(values) - set(LocaConfig().to_dict()))
    if unknown:
        raise ValueError(f"--config {path}: unknown LoCA setting(s) {unknown}")
    return values


@dataclass
class RunSetup:
    """What every recipe starts from: the task, its splits, the model and its tokenizer."""

    cfg: LocaConfig
    task: Task
    splits: Splits
    data_dir: str | None
    model: object
    tokenizer: object
    parts: ModelParts

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

    def encode(self, examples) -> list[Encoded]:
        """Prompt + gold completion sequences, with the run's max length and EOS setting."""
        return encode_examples(
            self.tokenizer, self.task, examples, max_length=self.cfg.max_length, add_eos=self.cfg.add_eos
        )

    def batches(self, items: list[Encoded]) -> list[Batch]:
        return make_batches(items, self.pad_id, batch_size=self.cfg.batch_size)

    def calibrator(
        self, train: list[Encoded], heldout: list[Encoded] = (), progress: bool = False
    ) -> Calibrator:
        """Stage I bound to the run's configuration and data (see :class:`loca.calibrate.Calibrator`)."""
        return Calibrator(self.parts, train, heldout, self.cfg, self.pad_id, progress=progress)


def refuse_flags(args: argparse.Namespace, names: set[str], why: str) -> None:
    """Raise ValueError if any LoCA flag in ``names`` was given on the command line."""
    given = sorted(names & set(dataclass_from_args(LocaConfig, args, build=False)))
    if given:
        flags = ", ".join("--" + g.replace("_", "-") for g in given)
        raise ValueError(f"{flags} {why}")


def warn(message: str) -> None:
    """A warning line on stderr (the run goes on)."""
    print(f"loca: warning: {message}", file=sys.stderr)


def fit_to_context(max_length: int, model) -> int:
    """``max_length`` clamped to the model's context length, warning when it had to be."""
    length, note = clamp_max_length(max_length, model)
    if note:
        warn(f"--{note.replace('_', '-', 1)}")
    return length


def setup_run(args: argparse.Namespace) -> RunSetup:
    """Parse the config, load the task's splits (before the model: data errors come first), then
    load the model; warn about degenerate data and clamp ``max_length`` to the model's context."""
    cfg = config_from_args(args)
    task = get_task(args.task, template=args.template)
    data_dir = resolve_data_dir(args.data_dir)
    splits = load_splits(
        task, n_train=args.n_train, n_heldout=args.n_heldout, n_test=args.n_test, seed=cfg.seed,
        data_dir=data_dir,
    )  # fmt: skip
    for message in degenerate_warnings(splits):
        warn(f"task {task.name!r}: {message}")
    model, tokenizer, parts = setup_model(args)
    cfg = replace(cfg, max_length=fit_to_context(cfg.max_length, model))
    return RunSetup(cfg, task, splits, data_dir, model, tokenizer, parts)


def setup_model(args: argparse.Namespace):
    """``(model, tokenizer, parts)`` from the model flags."""
    model, tokenizer = load_model(
        args.model, device=args.device, dtype=args.dtype, random_init=args.random_init,
        trust_remote_code=args.trust_remote_code,
    )  # fmt: skip
    return model, tokenizer, find_parts(model)
