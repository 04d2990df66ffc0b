"""Argument groups generated from the configuration sections, and the set-up shared by the
recipes: flags → (ModelConfig, DataConfig, LocaConfig) → :class:`loca.pipeline.Pipeline`.

One precedence for every command (fit, calibrate, evaluate, bench, compare), in
:func:`resolve_section`; the first that sets a value wins:

1. the flags given on the command line (every section flag is "given or not": a flag left out
   sets nothing);
2. ``--config FILE`` (that section of it);
3. ``--preset`` (the LoCA section only);
4. the command's defaults (e.g. ``loca bench``'s ``n_train=64``), then the field's own default.

So a run's own ``config.json`` reproduces it and a flag on top changes just that value. The
data folder, when none of these names one, is ``$LOCA_DATA_DIR``
(:func:`loca.data.sources.resolve_data_dir`). The sections are frozen once resolved."""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, fields
from pathlib import Path
from typing import get_args, get_origin

from ..config import (
    PRESETS,
    SECTION_CLASSES,
    SECTIONS,
    DataConfig,
    LocaConfig,
    ModelConfig,
    field_types,
    preset_values,
    sections_from_dict,
)
from ..data import TASKS
from ..data.sources import resolve_data_dir
from ..method.artefacts import read_adapter_config, recorded_base, recorded_task
from ..pipeline import Pipeline

log = logging.getLogger("loca")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model section's flags."""
    add_dataclass_args(p, ModelConfig, title="model", only_given=True)


def add_data_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The data section's flags; ``defaults`` are this command's (e.g. ``n_train=512``)."""
    add_dataclass_args(p, DataConfig, title="data", only_given=True, defaults=defaults)


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--quiet", action="store_true", help="warnings and errors only; no progress bars")
    g.add_argument("--verbose", action="store_true", help="also debug messages")


def add_dataclass_args(
    p: argparse.ArgumentParser,
    cls,
    *,
    title: str,
    prefix: str = "",
    skip: tuple[str, ...] = (),
    only_given: bool = False,
    defaults: dict | None = None,
    section: str | None = None,
    description: str | None = None,
) -> argparse._ArgumentGroup:
    """One flag per field of the dataclass ``cls`` (``--{prefix}-{field}``), with its help text and
    default (``defaults`` overrides the field's, for this command); lists take several values,
    booleans ``--x/--no-x``, fields with ``choices`` metadata are checked. ``section``: only the
    fields of that section. With ``only_given`` a flag left out sets nothing (a config file, a
    preset or ``defaults`` supply the value)."""
    g = p.add_argument_group(title, description)
    for f in fields(cls):
        if f.name in skip or (section and f.metadata.get("section") != section):
            continue
        flag = "--" + (f"{prefix}-" if prefix else "") + f.name.replace("_", "-")
        dest = (f"{prefix.replace('-', '_')}_" if prefix else "") + f.name
        default = f.default if f.default is not MISSING else f.default_factory()
        default = (defaults or {}).get(f.name, default)
        help_text = f.metadata["help"] + f" (default {default})"
        if only_given:
            default = argparse.SUPPRESS
        kind = _field_type(cls, f.name)
        if kind is bool:
            g.add_argument(
                flag, dest=dest, default=default, action=argparse.BooleanOptionalAction, help=help_text
            )
        elif isinstance(kind, list):
            g.add_argument(
                flag,
                dest=dest,
                type=_comma_list(kind[0]),
                nargs="+",
                default=default,
                help=help_text + "; space- or comma-separated",
            )
        else:
            g.add_argument(
                flag, dest=dest, type=kind, default=default, help=help_text, choices=f.metadata.get("choices")
            )
    return g


def _comma_list(kind):
    """Parse one command-line word as a comma-separated list (``sst2,boolq`` or ``0,1,2``)."""

    def parse(word: str) -> list:
        return [kind(x) for x in word.split(",") if x]

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def _field_type(cls, name: str):
    """``bool``, a scalar type, or ``[element type]`` for a list field, from the field's real
    annotation (``X | None`` as ``X``)."""
    kind = field_types(cls)[name]
    if get_origin(kind) is list:
        kind = [get_args(kind)[0]]
    if (kind[0] if isinstance(kind, list) else kind) not in (bool, int, float, str):
        raise TypeError(f"no command-line type for field {name}: {kind}")
    return kind


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


def add_config_args(
    p: argparse.ArgumentParser,
    skip: tuple[str, ...] = (),
    sections: tuple[str, ...] = tuple(SECTIONS),
    notes: dict[str, str] | None = None,
) -> None:
    """The LoCA section's flags, one group per section (``notes`` adds a line to a group's
    description), plus ``--preset`` and ``--config``."""
    for section in sections:
        add_dataclass_args(
            p,
            LocaConfig,
            title=f"LoCA: {SECTIONS[section]}",
            skip=skip,
            only_given=True,
            section=section,
            description=(notes or {}).get(section),
        )
    g = p.add_argument_group("configuration")
    g.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="named LoCA configuration the flags start from ('paper': the paper's method; default 'default')",
    )
    g.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="settings from a JSON or YAML file: a run's config.json, an object of model, data "
        "and loca sections, or one of settings at the top level; checked like the flags, and "
        "flags given override it (trust_remote_code is never read from it: pass the flag)",
    )


def read_config_file(path: str) -> dict:
    """The sections (``model``, ``data``, ``loca``) a JSON or YAML file holds
    (:func:`loca.config.sections_from_dict`: sectioned or flat, every value checked and converted
    as its flag would be); any error names the file."""
    text_path = Path(path)
    try:
        text = text_path.read_text()
        if text_path.suffix in (".yaml", ".yml"):
            import yaml

            obj = yaml.safe_load(text)
        else:
            import json

            obj = json.loads(text)
    except Exception as exc:  # OSError, JSON or YAML syntax: one message
        raise ValueError(f"--config {path}: not a readable JSON/YAML file ({exc})") from None
    try:
        return sections_from_dict(obj)
    except ValueError as exc:
        raise ValueError(f"--config {path}: {exc}") from None


def _file_sections(args: argparse.Namespace) -> dict:
    """``--config FILE``'s sections, read once per command line."""
    if not getattr(args, "config", None):
        return {}
    if getattr(args, "_config_sections", None) is None:
        args._config_sections = read_config_file(args.config)
    return args._config_sections


def resolve_section(args: argparse.Namespace, name: str, **defaults):
    """The section ``name`` (``model``, ``data`` or ``loca``) of a run, every value from the first
    that sets it: the flags given, ``--config FILE``, ``--preset`` (``loca`` only), ``defaults``
    (the command's), the field's default. The data folder falls back to ``$LOCA_DATA_DIR``."""
    cls = SECTION_CLASSES[name]
    preset = preset_values(getattr(args, "preset", None) or "default") if name == "loca" else {}
    from_file = dict(_file_sections(args).get(name, {}))
    if name == "model":
        refuse_remote_code_from_file(from_file.pop("trust_remote_code", False), args)
    values = {
        **defaults,
        **preset,
        **from_file,
        **dataclass_from_args(cls, args, build=False),
    }
    if name == "data":
        values["data_dir"] = resolve_data_dir(values.get("data_dir"))
    return cls(**values)


def refuse_remote_code_from_file(asked: bool, args: argparse.Namespace) -> None:
    """``trust_remote_code`` comes from the command line only: a ``--config`` file that asks for it
    (it would run Python code shipped with the model) is refused unless the flag is given (which
    then decides, as it always does)."""
    if asked and not hasattr(args, "trust_remote_code"):
        raise ValueError(
            f"--config {args.config}: trust_remote_code is not taken from a config file (it would run "
            "Python code shipped with the model); pass --trust-remote-code on the command line to allow it"
        )


def config_from_args(args: argparse.Namespace) -> LocaConfig:
    """The LoCA section (:func:`resolve_section`)."""
    return resolve_section(args, "loca")


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The model section (:func:`resolve_section`)."""
    return resolve_section(args, "model")


def sections_from_args(
    args: argparse.Namespace, **data_defaults
) -> tuple[ModelConfig, DataConfig, LocaConfig]:
    """The three sections of a run (``data_defaults``: this command's data defaults)."""
    data = resolve_section(args, "data", **data_defaults)
    return model_config_from_args(args), data, config_from_args(args)


def pipeline_from_args(args: argparse.Namespace, adapter: dict | None = None, **data_defaults) -> Pipeline:
    """The run the flags describe (nothing loaded yet). ``adapter``: an adapter folder's config,
    whose base model (at its revision) is loaded unless the model is named
    (:func:`model_from_adapter`)."""
    model, revision = model_from_adapter(args, adapter)
    data = resolve_section(args, "data", **data_defaults)
    cfg = config_from_args(args)
    return Pipeline(model, data, cfg, progress=not getattr(args, "quiet", False), revision=revision)


def given(args: argparse.Namespace, section: str, name: str) -> bool:
    """Whether a flag or ``--config FILE`` sets field ``name`` of ``section``."""
    return hasattr(args, name) or name in _file_sections(args).get(section, {})


def adapter_config(args: argparse.Namespace) -> dict | None:
    """The config of the ``--adapter`` folder (read without the model), or None without one."""
    return read_adapter_config(args.adapter) if getattr(args, "adapter", None) else None


def model_from_adapter(args: argparse.Namespace, config: dict | None) -> tuple[ModelConfig, str | None]:
    """The model section (:func:`resolve_section`) with the base model an adapter ``config``
    records below the flags and ``--config`` (so ``--model`` still wins), and the revision to
    load it at (the recorded one, when the recorded model is the one loaded). An adapter that
    records no base model needs ``--model``."""
    if config is None:
        return model_config_from_args(args), None
    recorded, revision = recorded_base(config)
    if recorded is None and not given(args, "model", "model"):
        raise ValueError(f"--adapter {args.adapter} does not record its base model; pass --model")
    model = resolve_section(args, "model", **({"model": recorded} if recorded else {}))
    return model, revision if recorded is not None and model.model == recorded else None


def data_from_adapter(args: argparse.Namespace, config: dict) -> tuple[dict, bool | None]:
    """``(data defaults, add_eos)`` from what an adapter ``config`` records of its task: the task
    and template (below the flags and ``--config``: ``--task`` and ``--template`` win) and
    ``add_eos``. A ``--task`` naming another built-in task brings its own template and EOS
    setting; a ``--task FILE`` keeps the adapter's template and EOS setting unless told. An
    adapter of an earlier loca records only its task's name: a built-in task is found by it, a
    user task needs ``--task``."""
    record = recorded_task(config)
    task_given = given(args, "data", "task")
    if "task" not in record and config.get("task") in TASKS:
        record["task"] = config["task"]
    if "task" not in record and not task_given:
        fitted = f" (it was fitted on the user task {config['task']!r})" if config.get("task") else ""
        raise ValueError(
            f"--adapter {args.adapter} does not record its task file{fitted}; pass --task (and --template)"
        )
    if task_given:
        task = getattr(args, "task", None) or _file_sections(args)["data"]["task"]
        if task in TASKS and task != record.get("task"):
            return {}, None
    defaults = {k: record[k] for k in ("task", "template") if k in record}
    if "template" in defaults:  # as a flag would give it: a backslash in it stays one
        defaults["template"] = defaults["template"].replace("\\", "\\\\")
    return defaults, record.get("add_eos")


def given_loca_flags(args: argparse.Namespace) -> set[str]:
    """The LoCA fields given as flags on the command line."""
    return set(dataclass_from_args(LocaConfig, args, build=False))


def refuse_flags(args: argparse.Namespace, names: set[str], why: str) -> None:
    """Raise ValueError if any LoCA flag in ``names`` was given on the command line."""
    given = sorted(names & given_loca_flags(args))
    if given:
        flags = ", ".join("--" + g.replace("_", "-") for g in given)
        raise ValueError(f"{flags} {why}")


def section_fields(section: str) -> set[str]:
    """The LocaConfig fields of one section (``calibration``, ``fit`` or ``shared``)."""
    return {f.name for f in fields(LocaConfig) if f.metadata["section"] == section}


def warn(message: str) -> None:
    """A warning line on stderr (the run goes on)."""
    log.warning(message)
