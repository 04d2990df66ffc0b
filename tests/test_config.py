"""The configuration sections: validation, round trip through the JSON a run records, the CLI
flags; frozen once built, one definition of each set of allowed values, one precedence."""

import argparse
import json
from dataclasses import FrozenInstanceError, dataclass, fields, replace

import pytest

from loca.baselines import AdapterBpSettings, LoraSettings, MezoSettings
from loca.cli.args import add_config_args, add_dataclass_args, config_from_args, dataclass_from_args
from loca.config import DataConfig, LocaConfig, ModelConfig, Settings, choices, option

pytestmark = pytest.mark.unit


def test_round_trip_through_json():
    cfg = LocaConfig(rank=8, etas=[0.01], lam_rel=[1e-2, 1e-3], groups=3, add_eos=False)
    again = LocaConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize(
    "bad", [dict(rank=0), dict(etas=[]), dict(etas=[-0.1]), dict(lam_rel=[0.0]), dict(max_length=1)]
)
def test_invalid_values_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LocaConfig(**bad)


def test_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        LocaConfig.from_dict({"rank": 4, "learning_rate": 1.0})


def test_cli_flags_mirror_the_dataclass():
    p = argparse.ArgumentParser()
    add_config_args(p)
    args = p.parse_args(["--rank", "4", "--etas", "0.1", "0.2", "--no-add-eos", "--groups", "2"])
    cfg = config_from_args(args)
    assert cfg == LocaConfig(rank=4, etas=[0.1, 0.2], add_eos=False, groups=2)
    assert config_from_args(p.parse_args([])) == LocaConfig()


def test_paper_preset_and_flags_on_top_of_it():
    paper = LocaConfig.preset("paper")
    assert (
        paper.feedback_rank,
        paper.beta_rel,
        paper.etas,
        paper.step_control,
        paper.ridge_center,
        paper.a_init,
        paper.recalibrate_every,
    ) == (8, 1e-3, [0.003, 0.01, 0.03], "fixed", "zero", "random", 0)
    p = argparse.ArgumentParser()
    add_config_args(p)
    cfg = config_from_args(p.parse_args(["--preset", "paper", "--beta-rel", "1", "--no-add-eos"]))
    assert cfg == LocaConfig.preset("paper", beta_rel=1.0, add_eos=False)
    with pytest.raises(ValueError, match="unknown preset"):
        LocaConfig.preset("nope")


@pytest.mark.parametrize(
    "bad",
    [
        dict(step_control="sgd"),
        dict(eta_grow=0.5),
        dict(eta_shrink=1.0),
        dict(a_init="pca"),
        dict(ridge_center="one"),
        dict(recalibrate_every=-1),
        dict(alignment_every=-1),
    ],
)
def test_invalid_fit_options_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LocaConfig(**bad)


def test_config_file_then_flags(tmp_path):
    p = argparse.ArgumentParser()
    add_config_args(p)
    run = {"command": "fit", "loca": LocaConfig(rank=4, beta_rel=0.5, etas=[0.02]).to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(run))
    cfg = config_from_args(p.parse_args(["--config", str(tmp_path / "config.json"), "--rank", "8"]))
    assert cfg == LocaConfig(rank=8, beta_rel=0.5, etas=[0.02])  # the flag over the file
    (tmp_path / "bare.json").write_text(json.dumps({"feedback_rank": 4}))
    cfg = config_from_args(p.parse_args(["--preset", "paper", "--config", str(tmp_path / "bare.json")]))
    assert cfg == LocaConfig.preset("paper", feedback_rank=4)  # the file over the preset
    (tmp_path / "bad.json").write_text(json.dumps({"learning_rate": 1}))
    with pytest.raises(ValueError, match="bad.json: unknown setting 'learning_rate'"):
        config_from_args(p.parse_args(["--config", str(tmp_path / "bad.json")]))
    (tmp_path / "bad.json").write_text(json.dumps({"loca": {"learning_rate": 1}}))
    with pytest.raises(ValueError, match="bad.json: unknown LoCA setting"):
        config_from_args(p.parse_args(["--config", str(tmp_path / "bad.json")]))


def test_a_yaml_config_holds_every_section(tmp_path):
    """``--config x.yaml`` with model, data and LoCA sections; flags given still win."""
    from loca.cli.args import add_data_args, add_model_args, sections_from_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    add_data_args(p, n_train=128)
    add_config_args(p)
    (tmp_path / "run.yaml").write_text(
        "model:\n  model: some/model\n  dtype: bfloat16\n"
        "data:\n  task: boolq\n  n_train: 300\n"
        "loca:\n  beta_rel: 0.25\n  etas: [0.01, 0.02]\n"
    )
    args = p.parse_args(["--config", str(tmp_path / "run.yaml"), "--n-train", "7"])
    model, data, cfg = sections_from_args(args)
    assert (model.model, model.dtype) == ("some/model", "bfloat16")
    assert (data.task, data.n_train, data.n_heldout) == ("boolq", 7, 64)
    assert cfg == LocaConfig(beta_rel=0.25, etas=[0.01, 0.02])
    (tmp_path / "bad.yaml").write_text("data:\n  n_epochs: 3\n")
    with pytest.raises(ValueError, match="unknown data setting"):
        sections_from_args(p.parse_args(["--config", str(tmp_path / "bad.yaml")]))


# -- config files are checked like flags ------------------------------------------------------------


def _full_parser() -> argparse.ArgumentParser:
    from loca.cli.args import add_data_args, add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    add_data_args(p, n_train=128)
    add_config_args(p)
    return p


def _sections(tmp_path, text: str, *flags: str, name: str = "c.yaml"):
    from loca.cli.args import sections_from_args

    (tmp_path / name).write_text(text)
    return sections_from_args(_full_parser().parse_args(["--config", str(tmp_path / name), *flags]))


@pytest.mark.parametrize(
    "text, field, want",
    [
        ('loca: {add_eos: "false"}', "add_eos", False),
        ('loca: {add_eos: "True"}', "add_eos", True),
        ('loca: {rank: "4"}', "rank", 4),
        ("loca: {beta_rel: 1e-3}", "beta_rel", 1e-3),  # YAML 1.1 reads 1e-3 as a string
        ("loca: {beta_rel: 2}", "beta_rel", 2.0),
        ('loca: {etas: "0.01"}', "etas", [0.01]),
        ('loca: {etas: "0.01, 0.03"}', "etas", [0.01, 0.03]),
        ("loca: {lam_rel: 0.001}", "lam_rel", [0.001]),
        ("loca: {etas: [1, 2]}", "etas", [1.0, 2.0]),
    ],
)
def test_config_file_values_are_converted_as_their_flags_would_be(tmp_path, text, field, want):
    cfg = _sections(tmp_path, text)[2]
    got = getattr(cfg, field)
    assert got == want and type(got) is type(want)
    if isinstance(got, list):
        assert all(type(x) is float for x in got)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("loca: {add_eos: maybe}", "loca.add_eos must be true or false, not 'maybe'"),
        ("loca: {add_eos: 1}", "loca.add_eos must be true or false"),
        ("loca: {rank: true}", "loca.rank must be an integer, not True"),
        ("loca: {rank: 4.5}", "loca.rank must be an integer, not 4.5"),
        ('loca: {rank: "four"}', "loca.rank must be an integer, not 'four'"),
        ("loca: {beta_rel: false}", "loca.beta_rel must be a number"),
        ("loca: {etas: [0.01, x]}", "loca.etas must be a number, not 'x'"),
        ("loca: {rank: null}", "loca.rank must be set"),
        ("data: {template: 5}", "data.template must be a string"),
        ("data: {n_train: 2.5}", "data.n_train must be an integer"),
        ("model: {model: m, random_init: 'no'}", "model.random_init must be true or false"),
        ("dat: {n_train: 3}\nloca: {rank: 4}", "unknown section 'dat'"),
        ("loca: {rank: 4}\nn_train: 3", "'n_train' is a data setting outside its section"),
        ("loca: {rank: 4}\nsplits: x", "unknown section 'splits'"),  # only a run's record has it
        ("rank: 4\nn_trian: 3", "unknown setting 'n_trian'"),
        ("loca: 3", "section 'loca' must be an object"),
        ("- rank", "expected a JSON/YAML object"),
    ],
)
def test_config_file_values_of_the_wrong_type_or_place_are_refused_naming_file_and_key(
    tmp_path, text, needle
):
    with pytest.raises(ValueError) as exc:
        _sections(tmp_path, text)
    assert str(exc.value).startswith(f"--config {tmp_path / 'c.yaml'}: ") and needle in str(exc.value)


def test_a_flat_config_file_sets_every_section(tmp_path):
    """Flat layout: every setting at the top level goes to its section (a top-level ``model``
    used to swallow the rest); flags given still win."""
    model, data, cfg = _sections(
        tmp_path, "model: some/model\ndtype: bfloat16\nrank: 8\nn_train: 24\netas: 0.02\n", "--n-train", "7"
    )
    assert (model.model, model.dtype, data.n_train, cfg.rank, cfg.etas) == (
        "some/model",
        "bfloat16",
        7,
        8,
        [0.02],
    )
    model, data, cfg = _sections(
        tmp_path, json.dumps({"model": "m", "rank": 8, "n_train": 24}), name="c.json"
    )
    assert (model.model, data.n_train, cfg.rank) == ("m", 24, 8)


def test_flat_settings_are_unambiguous_and_records_are_read_for_their_sections():
    """No field name is in two sections (so a flat file means one thing); a record that loca
    wrote (it names its ``command``) is read for its sections, its other keys skipped."""
    from loca.config import SECTION_CLASSES, section_of, sections_from_dict

    names = [f.name for cls in SECTION_CLASSES.values() for f in fields(cls)]
    assert len(names) == len(set(names))
    assert section_of("rank") == "loca" and section_of("n_test") == "data" and section_of("dtype") == "model"
    record = {
        "command": "fit",
        "model": {"model": "m"},
        "loca": {"rank": 4},
        "splits": {"seed": 0},
        "data_fingerprint": "ab",
        "device": "cpu",
    }
    assert sections_from_dict(record) == {"model": {"model": "m"}, "loca": {"rank": 4}}
    compare = {"command": "compare", "model": "m", "dtype": "bfloat16", "loca": {"rank": 4}, "data_dir": "d"}
    assert sections_from_dict(compare) == {"model": {"model": "m", "dtype": "bfloat16"}, "loca": {"rank": 4}}


def test_trust_remote_code_comes_from_the_command_line_only(tmp_path):
    """A config file that asks for trust_remote_code is refused unless the flag is given, which then
    decides; a file's ``false`` changes nothing."""
    text = json.dumps({"model": {"model": "m", "trust_remote_code": True}})
    with pytest.raises(
        ValueError, match="trust_remote_code is not taken from a config file.*--trust-remote-code"
    ):
        _sections(tmp_path, text, name="c.json")
    assert _sections(tmp_path, text, "--trust-remote-code", name="c.json")[0].trust_remote_code is True
    assert _sections(tmp_path, text, "--no-trust-remote-code", name="c.json")[0].trust_remote_code is False
    flat = json.dumps({"model": "m", "trust_remote_code": True})
    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        _sections(tmp_path, flat, name="c.json")
    off = json.dumps({"model": {"model": "m", "trust_remote_code": False}})
    assert _sections(tmp_path, off, name="c.json")[0].trust_remote_code is False


# -- frozen sections, one definition of the allowed values, one precedence ----------------------

SETTINGS_CLASSES = [LocaConfig, ModelConfig, DataConfig, LoraSettings, MezoSettings, AdapterBpSettings]
CHANGES = {  # a field, a valid new value and an invalid one
    LocaConfig: ("rank", 5, 0),
    ModelConfig: ("dtype", "bfloat16", "int8"),
    DataConfig: ("n_train", 5, -1),
    LoraSettings: ("rank", 5, 0),
    MezoSettings: ("max_steps", 5, 0),
    AdapterBpSettings: ("epochs", 5, 0),
}


@pytest.mark.parametrize("cls", SETTINGS_CLASSES, ids=lambda c: c.__name__)
def test_resolved_configuration_is_frozen(cls):
    """No field of a built configuration can be assigned; dataclasses.replace is the way to change
    one, and it validates again."""
    obj = cls()
    for f in fields(cls):
        with pytest.raises(FrozenInstanceError):
            setattr(obj, f.name, getattr(obj, f.name))
    name, good, bad = CHANGES[cls]
    assert getattr(replace(obj, **{name: good}), name) == good and obj == cls()
    with pytest.raises(ValueError, match=f"invalid {cls.__name__} values: {name}="):
        replace(obj, **{name: bad})


def test_list_fields_stay_json_lists_of_floats():
    cfg = LocaConfig(etas=(1, 2), lam_rel=[1])
    assert cfg.etas == [1.0, 2.0] and all(type(x) is float for x in cfg.etas + cfg.lam_rel)
    assert json.dumps(cfg.to_dict()["etas"]) == "[1.0, 2.0]"
    assert LoraSettings(target_modules=("q_proj",)).to_dict()["target_modules"] == ["q_proj"]
    assert MezoSettings().lrs is None and MezoSettings(lrs=[1]).lrs == [1.0]


def _choice_fields():
    return [
        pytest.param(cls, f, id=f"{cls.__name__}.{f.name}")
        for cls in SETTINGS_CLASSES
        for f in fields(cls)
        if f.metadata.get("choices")
    ]


@pytest.mark.parametrize("cls, f", _choice_fields())
def test_allowed_values_come_from_one_place(cls, f):
    """A field's ``choices`` is the validation, the flag's choices and the values its help lists."""
    allowed = choices(cls, f.name)
    assert allowed and allowed == f.metadata["choices"]
    p = argparse.ArgumentParser()
    add_dataclass_args(p, cls, title="x")
    action = next(a for a in p._actions if a.dest == f.name)
    assert tuple(action.choices) == allowed
    assert all(value in action.help for value in allowed)
    for value in allowed:
        assert getattr(cls(**{f.name: value}), f.name) == value
        assert getattr(p.parse_args([action.option_strings[0], value]), f.name) == value
    with pytest.raises(ValueError, match=f"{f.name}='nope' \\(choose from {', '.join(allowed)}\\)"):
        cls(**{f.name: "nope"})
    with pytest.raises(SystemExit):
        p.parse_args([action.option_strings[0], "nope"])


def test_allowed_values_agree_with_the_code_that_uses_them():
    """The modules that act on a value know exactly the values the configuration allows."""
    from loca.method.maps import GATES
    from loca.method.steps import STEP_CONTROLS
    from loca.models.parts import DTYPES as TORCH_DTYPES

    assert tuple(GATES) == choices(LocaConfig, "feedback_gate")
    assert tuple(STEP_CONTROLS) == choices(LocaConfig, "step_control")
    assert tuple(TORCH_DTYPES) == choices(ModelConfig, "dtype")
    assert choices(AdapterBpSettings, "a_init") == choices(LocaConfig, "a_init")
    assert ModelConfig(device_map=None).device_map is None  # an optional choice may stay unset


def test_flag_types_come_from_the_annotations():
    @dataclass(frozen=True)
    class Example(Settings):
        flag: bool = option(False, "a switch")
        count: int | None = option(None, "a count")
        scale: float = option(1.0, "a scale")
        names: list[str] = option(["a"], "names")
        values: list[float] | None = option(None, "values")

    p = argparse.ArgumentParser()
    add_dataclass_args(p, Example, title="x")
    args = p.parse_args(
        ["--no-flag", "--count", "3", "--scale", "2", "--names", "b,c", "d", "--values", "1", "2"]
    )
    got = dataclass_from_args(Example, args)
    assert got == Example(flag=False, count=3, scale=2.0, names=["b", "c", "d"], values=[1.0, 2.0])
    assert type(got.count) is int and type(got.scale) is float

    @dataclass
    class Odd:
        when: dict | None = option(None, "no flag type")

    with pytest.raises(TypeError, match="no command-line type for field when"):
        add_dataclass_args(argparse.ArgumentParser(), Odd, title="x")


def test_precedence_flags_then_file_then_preset_then_command_defaults(tmp_path, monkeypatch):
    """Every section: a flag given > ``--config FILE`` > ``--preset`` (LoCA) > the command's
    default > the field's default; the data folder falls back to $LOCA_DATA_DIR."""
    from loca.cli.args import add_data_args, add_model_args, sections_from_args

    monkeypatch.delenv("LOCA_DATA_DIR", raising=False)
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_data_args(p, n_train=11, n_heldout=12, n_test=13)
    add_config_args(p)
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "model": {"dtype": "bfloat16", "device": "cpu"},
                "data": {"n_train": 21, "n_heldout": 22},
                "loca": {"feedback_rank": 4, "max_iters": 7, "etas": [0.5]},
            }
        )
    )
    argv = ["--preset", "paper", "--config", str(tmp_path / "run.json")]
    model, data, cfg = sections_from_args(
        p.parse_args([*argv, "--device", "cuda", "--n-train", "31", "--max-iters", "9"]),
        n_train=11,
        n_heldout=12,
        n_test=13,
    )
    assert (model.model, model.dtype, model.device) == (ModelConfig().model, "bfloat16", "cuda")
    assert (data.n_train, data.n_heldout, data.n_test, data.task) == (31, 22, 13, DataConfig().task)
    paper = LocaConfig.preset("paper")
    assert (cfg.max_iters, cfg.feedback_rank, cfg.etas) == (9, 4, [0.5])  # flag, file, file
    assert (cfg.beta_rel, cfg.step_control, cfg.patience) == (paper.beta_rel, "fixed", paper.patience)
    assert cfg.rank == LocaConfig().rank and data.data_dir is None
    monkeypatch.setenv("LOCA_DATA_DIR", str(tmp_path / "env"))
    assert sections_from_args(p.parse_args([]))[1].data_dir == str(tmp_path / "env")
    assert sections_from_args(p.parse_args(["--data-dir", "given"]))[1].data_dir == "given"


class _Resolved(Exception):
    """Raised where a command would start work, carrying what it was given."""


@pytest.mark.parametrize("command", ["fit", "calibrate", "evaluate", "bench", "compare"])
def test_every_command_resolves_through_one_function(command, tmp_path, monkeypatch):
    """fit, calibrate, evaluate, bench and compare build their sections with resolve_section, so
    the precedence above holds for each (compare: the model and LoCA sections)."""
    import loca.cli.args as cli_args
    import loca.cli.compare_command as compare_command
    from loca.cli.main import build_parser

    seen, real = [], cli_args.resolve_section

    def spy(args, name, **defaults):
        seen.append(name)
        return real(args, name, **defaults)

    def stop(*a, **kw):
        raise _Resolved(a, kw)

    monkeypatch.setattr(cli_args, "resolve_section", spy)
    monkeypatch.setattr(cli_args, "Pipeline", stop)
    monkeypatch.setattr(compare_command, "run_compare", stop)
    monkeypatch.delenv("LOCA_DATA_DIR", raising=False)
    argv = [command, "--out", str(tmp_path / "out"), "--max-length", "99"]
    if command != "evaluate":
        (tmp_path / "c.json").write_text(json.dumps({"loca": {"max_length": 50, "feedback_rank": 3}}))
        argv += ["--preset", "paper", "--config", str(tmp_path / "c.json")]
    args = build_parser().parse_args(argv)
    with pytest.raises(_Resolved) as stopped:
        args._run(args)
    a, kw = stopped.value.args
    cfg = a[1].loca if command == "compare" else a[2]
    assert {"model", "loca"} <= set(seen) and (command == "compare" or "data" in seen)
    assert cfg.max_length == 99
    if command != "evaluate":
        assert (cfg.feedback_rank, cfg.max_iters) == (3, LocaConfig.preset("paper").max_iters)


def test_the_data_dir_variable_is_read_in_one_place():
    import pathlib
    import re

    import loca

    src = pathlib.Path(loca.__file__).parent
    reads = [
        f"{path.relative_to(src)}: {line.strip()}"
        for path in src.rglob("*.py")
        for line in path.read_text().splitlines()
        if re.search(r"environ.*(DATA_DIR_ENV|LOCA_DATA_DIR)", line)
    ]
    assert len(reads) == 1 and reads[0].startswith("data/sources.py"), reads
