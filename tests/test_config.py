"""LocaConfig: validation, round trip through the JSON a run records, and the CLI flags."""

import argparse
import json

import pytest

from loca.config import LocaConfig
from loca.recipes.common import add_config_args, config_from_args


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
