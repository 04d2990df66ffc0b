"""The `loca` command end to end on a tiny saved model, tokenizer and JSON Lines task."""

import json

import pytest
from tiny import (
    SENTIMENT_TEMPLATE,
    save_model_and_task,
    tiny_cli_args,
    tiny_model,
    tiny_tokenizer,
)

from loca.cli.main import main

pytestmark = pytest.mark.integration

TEMPLATE = SENTIMENT_TEMPLATE


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = save_model_and_task(tmp_path_factory.mktemp("cli"), 60)
    common = tiny_cli_args(root)
    return root, common


def test_fit_writes_config_history_results_adapter_and_maps(setup, capsys):
    root, common = setup
    out = root / "fit"
    args = ["fit", *common, "--n-train", "16", "--n-heldout", "8", "--n-test", "10"]
    assert main([*args, "--max-iters", "2", "--etas", "0.01", "0.03", "--out", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    for name in ("frozen", "loca"):
        assert {"heldout_ce", "test_ce", "test_acc"} <= results[name].keys()
    assert {"eta", "lam_rel", "best_iteration", "wall_time_s", "alignment"} <= results.keys()
    assert len(results["alignment"]["probe"]) == 2
    assert 0 <= results["padding_fraction"]["train"] < 0.5
    assert results["loca"]["heldout_ce"] <= results["frozen"]["heldout_ce"]
    config = json.loads((out / "config.json").read_text())
    assert config["loca"]["rank"] == 4 and config["splits"]["seed"] == 0
    rows = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert rows[0]["iteration"] == 0 and len(rows) >= 3
    assert (out / "adapter" / "loca_adapter.safetensors").is_file()
    assert (out / "maps" / "feedback_maps.safetensors").is_file()
    assert "frozen" in capsys.readouterr().out


def test_calibrate_then_forward_only_fit_then_evaluate(setup):
    root, common = setup
    assert (
        main(
            [
                "calibrate",
                *common[:-4],
                "--feedback-rank",
                "4",
                "--n-train",
                "16",
                "--n-heldout",
                "8",
                "--out",
                str(root / "maps"),
            ]
        )
        == 0
    )
    out = root / "fit2"
    stage2 = common[:-2]  # without --feedback-rank 4
    args = ["fit", *stage2, "--n-train", "16", "--n-heldout", "8", "--n-test", "10"]
    args += ["--maps", str(root / "maps")]
    assert main([*args, "--max-iters", "1", "--out", str(out), "--quiet"]) == 0
    assert not (out / "maps").exists()
    # the recorded configuration is the maps' calibration, and calibration flags are refused
    assert json.loads((out / "config.json").read_text())["loca"]["feedback_rank"] == 4
    assert main([*args, "--feedback-rank", "8", "--out", str(root / "fit3")]) == 2
    ev = root / "eval"
    assert (
        main(["evaluate", *common[:6], "--n-test", "10", "--adapter", str(out / "adapter"), "--out", str(ev)])
        == 0
    )
    got = json.loads((ev / "results.json").read_text())
    want = json.loads((out / "results.json").read_text())["loca"]
    assert got["test_ce"] == pytest.approx(want["test_ce"], rel=1e-6)


def test_maps_from_another_checkpoint_are_refused(setup, capsys):
    root, common = setup
    other = tiny_model(tiny_tokenizer(), seed=1)
    other.save_pretrained(root / "other")
    tiny_tokenizer().save_pretrained(root / "other")
    if not (root / "maps").exists():
        main(
            [
                "calibrate",
                *common[:-4],
                "--feedback-rank",
                "4",
                "--n-train",
                "16",
                "--n-heldout",
                "8",
                "--out",
                str(root / "maps"),
            ]
        )
    args = ["fit", "--model", str(root / "other"), *common[2:-2], "--maps", str(root / "maps")]
    assert main([*args, "--n-train", "16", "--n-heldout", "8", "--n-test", "4", "--quiet"]) == 2
    assert "another checkpoint" in capsys.readouterr().err


def test_bad_data_is_a_clear_error(setup, tmp_path, capsys):
    _, common = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a b", "choices": ["x", "y"], "label": 5}\n')
    args = ["fit", *common[:2], "--task", str(bad), "--template", TEMPLATE, "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "label" in err


def test_bench_writes_one_row_per_phase(setup, capsys):
    root, common = setup
    out = root / "bench"
    args = ["bench", *common, "--n-train", "8", "--phases", "forward,calibrate,stage2", "--repeats", "1"]
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out  # a table of sizes, not a Python dict
    assert "{" not in printed and "Stage II statistics (float64, r² + k·r per block)" in printed
    assert "512 B  (512 bytes)" in printed  # 2 blocks × (4·4 + 4·4) × 8 bytes
    report = json.loads((out / "bench.json").read_text())
    assert [r["phase"] for r in report["rows"]] == ["forward", "calibrate", "stage2"]
    for row in report["rows"]:
        assert {"phase", "time_s", "time_s_min", "peak_mb", "median_mb"} <= row.keys()
        assert row["time_s"] > 0
    assert report["statistics_bytes"]["stage2_statistics"] == 2 * (4 * 4 + 4 * 4) * 8


def test_random_init_needs_only_config_and_tokenizer(setup, tmp_path):
    root, common = setup
    folder = tmp_path / "arch"
    folder.mkdir()
    for f in (root / "model").iterdir():
        if not f.name.endswith(".safetensors"):
            (folder / f.name).write_bytes(f.read_bytes())
    args = ["bench", "--model", str(folder), "--random-init", *common[2:], "--n-train", "8"]
    assert main([*args, "--phases", "stage2", "--repeats", "1", "--out", str(tmp_path / "b")]) == 0


def test_a_missing_model_is_a_clear_error(tmp_path, capsys):
    rows = [{"id": f"x{i}", "question": f"q {i}", "choices": ["a", "b"], "label": i % 2} for i in range(40)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = [
        "--task",
        str(tmp_path / "t.jsonl"),
        "--template",
        "{question}",
        "--n-test",
        "4",
        "--n-heldout",
        "4",
    ]
    assert main(["fit", "--model", str(tmp_path / "nowhere"), *data, "--quiet", "--n-train", "4"]) == 2
    assert "could not load model" in capsys.readouterr().err


def test_a_run_is_rerun_from_its_own_config(setup):
    root, common = setup
    data = ["--n-train", "16", "--n-heldout", "8", "--n-test", "10", "--quiet"]
    first = root / "cfg-a"
    assert main(["fit", *common, *data, "--max-iters", "3", "--beta-rel", "0.3", "--out", str(first)]) == 0
    again = root / "cfg-b"
    base = common[: common.index("--rank")] + ["--device", "cpu"]  # model and task flags only
    assert main(["fit", *base, *data, "--config", str(first / "config.json"), "--out", str(again)]) == 0
    a, b = (json.loads((d / "config.json").read_text())["loca"] for d in (first, again))
    assert a == b and a["beta_rel"] == 0.3 and a["max_iters"] == 3
    ra, rb = (json.loads((d / "results.json").read_text())["loca"] for d in (first, again))
    assert ra == rb


def test_generate_with_and_without_adapters(setup, capsys):
    root, common = setup
    out = root / "gen-fit"
    data = ["--n-train", "16", "--n-heldout", "8", "--n-test", "4", "--max-iters", "2", "--quiet"]
    assert main(["fit", *common, *data, "--out", str(out)]) == 0
    model = ["--model", str(root / "model"), "--device", "cpu"]
    capsys.readouterr()
    assert main(["generate", *model, "--prompt", "Review: a charming journey", "--max-new-tokens", "5"]) == 0
    frozen = capsys.readouterr().out
    assert frozen.startswith("[frozen] ")
    argv = [
        "generate",
        *model,
        "--prompt",
        "Review: a charming journey",
        "--max-new-tokens",
        "5",
        "--adapter",
        str(out / "adapter"),
        "--compare",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[loca] ") and lines[1] == frozen.strip()
    assert main(["generate", *model, "--prompt", "x", "--max-new-tokens", "0"]) == 2


def test_allowed_values_are_checked_from_flags_and_config_files_alike(tmp_path, capsys):
    """A value outside an option's choices is refused, with the same allowed values, whether it
    comes from a flag (argparse) or from --config (the dataclass); nothing is loaded."""
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--step-control", "sgd"])
    assert exited.value.code == 2 and "choose from 'fixed', 'adaptive'" in capsys.readouterr().err
    (tmp_path / "c.json").write_text(json.dumps({"loca": {"step_control": "sgd"}}))
    assert main(["fit", "--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "o")]) == 2
    assert "step_control='sgd' (choose from fixed, adaptive)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_adapter_brings_its_base_model_and_task(setup, tmp_path, monkeypatch, capsys):
    """A fit's adapter records the base model and task as named (relative paths here) with the
    template and EOS setting; `generate` and `evaluate --adapter` then need neither --model nor
    --task, from any working directory; flags given still win; an adapter that does not record
    its user task's file is an error, not a silent SST-2 evaluation."""
    root, common = setup
    monkeypatch.chdir(root)
    out = root / "self-describing"
    data = ["--n-train", "16", "--n-heldout", "8", "--n-test", "10", "--max-iters", "2", "--quiet"]
    flags = ["--model", "model", "--task", "task.jsonl", *common[4:]]
    assert main(["fit", *flags, *data, "--out", str(out)]) == 0
    cfg = json.loads((out / "adapter" / "loca_adapter.json").read_text())
    assert (cfg["base_model"], cfg["base_model_path"]) == ("model", str(root / "model"))
    task = (cfg["task"], cfg["task_source"], cfg["task_path"])
    assert task == ("task", "task.jsonl", str(root / "task.jsonl"))
    assert cfg["template"] == TEMPLATE and cfg["add_eos"] is True
    assert "task.jsonl" in (out / "adapter" / "README.md").read_text()
    monkeypatch.chdir(tmp_path)  # neither "model" nor "task.jsonl" exists from here
    adapter = ["--adapter", str(out / "adapter"), "--device", "cpu"]
    prompt = ["--prompt", "Review: a charming journey", "--max-new-tokens", "5"]
    capsys.readouterr()
    assert main(["generate", *adapter, *prompt]) == 0
    recorded = capsys.readouterr().out
    assert main(["generate", *adapter, *prompt, "--model", str(root / "model")]) == 0
    assert capsys.readouterr().out == recorded and recorded.startswith("[loca] ")
    assert main(["evaluate", *adapter, "--n-test", "10", "--out", "ev", "--quiet"]) == 0
    got = json.loads((tmp_path / "ev" / "results.json").read_text())
    want = json.loads((out / "results.json").read_text())["loca"]
    assert got["task"]["template"] == TEMPLATE and got["settings"]["add_eos"] is True
    assert got["test_ce"] == pytest.approx(want["test_ce"], rel=1e-6)
    # flags win: another model is refused naming the adapter's, --no-add-eos changes the CE
    other = root / "other"
    if not other.exists():
        tiny_model(tiny_tokenizer(), seed=1).save_pretrained(other)
        tiny_tokenizer().save_pretrained(other)
    assert main(["generate", *adapter, *prompt, "--model", str(other)]) == 2
    assert "fitted on model" in capsys.readouterr().err
    assert main(["evaluate", *adapter, "--n-test", "10", "--no-add-eos", "--out", "ev2", "--quiet"]) == 0
    assert json.loads((tmp_path / "ev2" / "results.json").read_text())["settings"]["add_eos"] is False
    # an adapter of an earlier loca: only the task's name, which is no built-in task
    legacy = {k: v for k, v in cfg.items() if k not in ("task_source", "task_path", "template", "add_eos")}
    (out / "adapter" / "loca_adapter.json").write_text(json.dumps(legacy))
    assert main(["evaluate", *adapter, "--out", "ev3", "--quiet"]) == 2
    assert "does not record its task file (it was fitted on the user task 'task')" in capsys.readouterr().err


def test_version_and_a_bad_flag_shows_its_subcommands_usage(capsys):
    from loca import __version__

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"loca {__version__}"
    for command in ("fit", "evaluate", "tasks"):
        with pytest.raises(SystemExit) as exited:
            main([command, "--out", "x", "--bogus"] if command != "tasks" else [command, "--bogus"])
        err = capsys.readouterr().err
        assert exited.value.code == 2
        assert err.startswith(f"usage: loca {command} ") and f"loca {command}: error: unrecognized" in err


def test_an_adapters_task_is_a_default_below_the_flags():
    """What an adapter records of its task, under the flags: another built-in --task brings its
    own template and EOS setting, a --task FILE keeps the adapter's; a recorded template is taken
    as it was (a backslash in it is not read as an escape)."""
    import argparse

    from loca.cli.args import data_from_adapter
    from loca.data import get_task

    template = "Q: {question}\\tA\n:"  # a literal backslash-t, and a newline
    record = {"task_source": "sst2", "task_path": None, "template": template, "add_eos": False}
    defaults, add_eos = data_from_adapter(argparse.Namespace(adapter="ad"), record)
    assert get_task(defaults["task"], defaults["template"]).template == template and add_eos is False
    assert data_from_adapter(argparse.Namespace(adapter="ad", task="boolq"), record) == ({}, None)
    defaults, add_eos = data_from_adapter(argparse.Namespace(adapter="ad", task="other.jsonl"), record)
    assert defaults["task"] == "sst2" and add_eos is False  # the --task flag wins over this default
