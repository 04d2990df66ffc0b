"""Argument groups generated from the configuration sections, and the set-up shared by the
recipes: flags → (ModelConfig, DataConfig, LocaConfig) → :class:`loca.pipeline.Pipeline`.

Every section flag is "given or not": a flag left out takes its value from ``--config FILE``, then
from ``--preset`` (LoCA section), then from the command's default, so a run's own ``config.json``
reproduces it and a flag on top changes just that value."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import MISSING, fields
from pathlib import Path

from ..config import PRESETS, SECTIONS, DataConfig, LocaConfig, ModelConfig, sections_from_dict
from ..data.sources import DATA_DIR_ENV
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


def resolve_data_dir(arg: str | None) -> str | None:
    """``--data-dir``, else ``$LOCA_DATA_DIR``, else None (the Hugging Face hub): recorded in run
    configs as given. Nothing else is searched."""
    return arg or os.environ.get(DATA_DIR_ENV) or None


def add_dataclass_args(
    p: argparse.ArgumentParser, cls, *, title: str, prefix: str = "", skip: tuple[str, ...] = (),
    only_given: bool = False, defaults: dict | None = None, section: str | None = None,
    description: str | None = None,
) -> argparse._ArgumentGroup:  # fmt: skip
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
        kind = _field_type(f)
        if kind is bool:
            g.add_argument(flag, dest=dest, default=default, action=argparse.BooleanOptionalAction,
                           help=help_text)  # fmt: skip
        elif isinstance(kind, list):
            g.add_argument(flag, dest=dest, type=_comma_list(kind[0]), nargs="+", default=default,
                           help=help_text + "; space- or comma-separated")
        else:
            g.add_argument(flag, dest=dest, type=kind, default=default, help=help_text,
                           choices=f.metadata.get("choices"))  # fmt: skip
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


def add_config_args(
    p: argparse.ArgumentParser, skip: tuple[str, ...] = (), sections: tuple[str, ...] = tuple(SECTIONS),
    notes: dict[str, str] | None = None,
) -> None:  # fmt: skip
    """The LoCA section's flags, one group per section (``notes`` adds a line to a group's
    description), plus ``--preset`` and ``--config``."""
    for section in sections:
        add_dataclass_args(p, LocaConfig, title=f"LoCA: {SECTIONS[section]}", skip=skip, only_given=True,
                           section=section, description=(notes or {}).get(section))  # fmt: skip
    g = p.add_argument_group("configuration")
    g.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="named LoCA configuration the flags start from ('paper': the paper's method; "
                   "default 'default')")  # fmt: skip
    g.add_argument("--config", default=None, metavar="FILE",
                   help="settings from a JSON or YAML file: a run's config.json (its model, data and "
                   "loca sections) or an object of LoCA settings; flags given override it")  # fmt: skip


def read_config_file(path: str) -> dict:
    """The sections (``model``, ``data``, ``loca``) a JSON or YAML file holds."""
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


def config_from_args(args: argparse.Namespace) -> LocaConfig:
    """The LoCA section: the preset, then ``--config FILE``, then the flags given."""
    given = dataclass_from_args(LocaConfig, args, build=False)
    from_file = _file_sections(args).get("loca", {})
    return LocaConfig.preset(getattr(args, "preset", None) or "default", **{**from_file, **given})


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The model section: its defaults, then ``--config FILE``, then the flags given."""
    return ModelConfig(**{**_file_sections(args).get("model", {}),
                          **dataclass_from_args(ModelConfig, args, build=False)})  # fmt: skip


def sections_from_args(
    args: argparse.Namespace, **data_defaults
) -> tuple[ModelConfig, DataConfig, LocaConfig]:
    """The three sections of a run (``data_defaults``: this command's data defaults)."""
    data = {**data_defaults, **_file_sections(args).get("data", {}),
            **dataclass_from_args(DataConfig, args, build=False)}  # fmt: skip
    data["data_dir"] = resolve_data_dir(data.get("data_dir"))
    return model_config_from_args(args), DataConfig(**data), config_from_args(args)


def pipeline_from_args(args: argparse.Namespace, **data_defaults) -> Pipeline:
    """The run the flags describe (nothing loaded yet)."""
    model, data, cfg = sections_from_args(args, **data_defaults)
    return Pipeline(model, data, cfg, progress=not getattr(args, "quiet", False))


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
