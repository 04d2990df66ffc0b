"""LocaConfig: validation, round trip through the JSON a run records, and the CLI flags."""

import argparse
import json

import pytest

from loca.cli.args import add_config_args, config_from_args
from loca.config import LocaConfig

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
    assert (paper.feedback_rank, paper.beta_rel, paper.etas, paper.step_control, paper.ridge_center,
            paper.a_init, paper.recalibrate_every) == (8, 1e-3, [0.003, 0.01, 0.03], "fixed", "zero",
                                                       "random", 0)  # fmt: skip
    p = argparse.ArgumentParser()
    add_config_args(p)
    cfg = config_from_args(p.parse_args(["--preset", "paper", "--beta-rel", "1", "--no-add-eos"]))
    assert cfg == LocaConfig.preset("paper", beta_rel=1.0, add_eos=False)
    with pytest.raises(ValueError, match="unknown preset"):
        LocaConfig.preset("nope")


@pytest.mark.parametrize(
    "bad",
    [dict(step_control="sgd"), dict(eta_grow=0.5), dict(eta_shrink=1.0), dict(a_init="pca"),
     dict(ridge_center="one"), dict(recalibrate_every=-1), dict(alignment_every=-1)],
)  # fmt: skip
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
    with pytest.raises(ValueError, match="unknown LoCA setting"):
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
