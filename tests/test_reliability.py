"""Safety of a user's files and models: run folders, artefact folders, strict JSON, foreign code,
non-finite metrics and one-line errors."""

import json
import os
import shutil

import pytest
import torch
from tiny import (
    SENTIMENT_TEMPLATE,
    save_model_and_task,
    tiny_cli_args,
    tiny_model,
    tiny_tokenizer,
)

import loca.infra.io as io_mod
from loca.cli.main import main
from loca.infra.io import FolderInUseError, atomic_dir, atomic_write_json
from loca.infra.runs import MARKER, RunFolderError, prepare_run_dir

TEMPLATE = SENTIMENT_TEMPLATE


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = save_model_and_task(tmp_path_factory.mktemp("reliability"), 40, seed=1)
    common = tiny_cli_args(root)
    return root, common


def user_folder(path):
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    return path


# -- artefact folders ---------------------------------------------------------------------------
@pytest.mark.unit
def test_atomic_dir_never_replaces_a_folder_it_did_not_make(tmp_path):
    mine = user_folder(tmp_path / "mine")
    with pytest.raises(FolderInUseError, match="refusing to replace"):
        with atomic_dir(mine, "loca_adapter.json", "loca-adapter") as tmp:
            (tmp / "x").write_text("new")
    assert (mine / "notes.txt").read_text() == "mine" and not (mine / "x").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # no temporary folder left behind


@pytest.mark.unit
def test_atomic_dir_replaces_its_own_kind_and_restores_it_if_the_swap_fails(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    for text in ("v1", "v2"):
        with atomic_dir(target, "cfg.json", "loca-adapter") as tmp:
            (tmp / "cfg.json").write_text(json.dumps({"format": "loca-adapter", "v": text}))
    assert json.loads((target / "cfg.json").read_text())["v"] == "v2"
    real, calls = os.replace, {"n": 0}

    def failing(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:  # the old copy has moved aside; the new one fails to move in
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(io_mod.os, "replace", failing)
    with pytest.raises(OSError, match="disk full"):
        with atomic_dir(target, "cfg.json", "loca-adapter") as tmp:
            (tmp / "cfg.json").write_text(json.dumps({"format": "loca-adapter", "v": "v3"}))
    assert json.loads((target / "cfg.json").read_text())["v"] == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


@pytest.mark.unit
def test_json_is_strict(tmp_path):
    with pytest.raises(ValueError, match="non-finite"):
        atomic_write_json(tmp_path / "r.json", {"test_ce": float("nan")})
    assert not (tmp_path / "r.json").exists()


# -- run folders --------------------------------------------------------------------------------
@pytest.mark.unit
def test_run_folder_rules(tmp_path, setup):
    root, _ = setup
    assert prepare_run_dir(tmp_path / "new", "fit").is_dir()
    prepare_run_dir(tmp_path / "new", "fit")  # a run that wrote nothing does not block a rerun
    (tmp_path / "new" / "results.json").write_text("{}")
    with pytest.raises(RunFolderError, match="already holds a `loca fit` run"):
        prepare_run_dir(tmp_path / "new", "fit")
    prepare_run_dir(tmp_path / "new", "fit", overwrite=True)
    with pytest.raises(RunFolderError, match="holds a `loca fit` run"):
        prepare_run_dir(tmp_path / "new", "evaluate", overwrite=True)
    prepare_run_dir(tmp_path / "cmp", "compare")
    prepare_run_dir(tmp_path / "cmp", "compare", resumable=True)  # compare continues its own folder
    mine = user_folder(tmp_path / "mine")
    with pytest.raises(RunFolderError, match="not a loca run folder"):
        prepare_run_dir(mine, "fit")
    prepare_run_dir(mine, "fit", overwrite=True)
    assert (mine / "notes.txt").read_text() == "mine" and (mine / MARKER).is_file()
    model = root / "model"
    for out in (model, model / "runs"):
        with pytest.raises(RunFolderError, match="model folder"):
            prepare_run_dir(out, "fit", model=model, overwrite=True)
    assert not (model / MARKER).exists() and not (model / "runs").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
@pytest.mark.unit
def test_a_read_only_out_fails_before_the_work(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(RunFolderError, match="cannot write"):
            prepare_run_dir(ro / "run", "fit")
    finally:
        ro.chmod(0o755)


@pytest.mark.integration
def test_commands_refuse_user_folders_and_model_folders(setup, tmp_path, capsys):
    root, common = setup
    model_files = sorted(p.name for p in (root / "model").iterdir())
    mine = user_folder(tmp_path / "mine")
    small = ["--n-train", "8", "--n-heldout", "4", "--n-test", "4", "--max-iters", "1"]
    cases = [
        ["fit", *common, *small, "--out", str(mine)],
        ["fit", *common, *small, "--out", str(root / "model")],
        ["calibrate", *common[:-4], "--n-train", "8", "--n-heldout", "4", "--out", str(mine)],
        ["calibrate", *common[:-4], "--n-train", "8", "--n-heldout", "4", "--out", str(root / "model")],
        [
            "evaluate",
            "--model",
            str(root / "model"),
            "--task",
            str(root / "task.jsonl"),
            "--template",
            TEMPLATE,
            "--device",
            "cpu",
            "--out",
            str(mine),
        ],
        ["bench", *common, "--n-train", "8", "--phases", "forward", "--out", str(mine)],
        ["compare", "--model", str(root / "model"), "--device", "cpu", "--tasks", "sst2", "--out", str(mine)],
        ["compare", "--out", str(mine), "--report-only"],
    ]
    for argv in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv[0]
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error:" in err, err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in (root / "model").iterdir()) == model_files


@pytest.mark.integration
def test_rerunning_fit_needs_overwrite_and_evaluate_never_replaces_a_fit(setup, tmp_path, capsys):
    root, common = setup
    run = [
        "fit",
        *common,
        "--n-train",
        "8",
        "--n-heldout",
        "4",
        "--n-test",
        "4",
        "--max-iters",
        "1",
        "--quiet",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(run) == 0
    before = (tmp_path / "run" / "results.json").read_text()
    assert main(run) == 2 and "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "run" / "results.json").read_text() == before
    ev = [
        "evaluate",
        "--model",
        str(root / "model"),
        "--task",
        str(root / "task.jsonl"),
        "--template",
        TEMPLATE,
        "--device",
        "cpu",
        "--n-test",
        "4",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main([*ev, "--overwrite"]) == 2
    assert (tmp_path / "run" / "results.json").read_text() == before
    assert main([*run, "--overwrite"]) == 0


@pytest.mark.integration
def test_non_finite_adapters_and_metrics_are_errors_and_nothing_is_written(setup, tmp_path, capsys):
    root, common = setup
    from safetensors.torch import load_file, save_file

    fit = [
        "fit",
        *common,
        "--n-train",
        "8",
        "--n-heldout",
        "4",
        "--n-test",
        "4",
        "--max-iters",
        "1",
        "--quiet",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(fit) == 0
    weights = tmp_path / "run" / "adapter" / "loca_adapter.safetensors"
    tensors = load_file(weights)
    tensors["B.0"] = torch.full_like(tensors["B.0"], float("nan"))
    save_file(tensors, weights)
    ev = [
        "evaluate",
        "--task",
        str(root / "task.jsonl"),
        "--template",
        TEMPLATE,
        "--device",
        "cpu",
        "--n-test",
        "4",
    ]
    capsys.readouterr()
    argv = [
        *ev,
        "--model",
        str(root / "model"),
        "--adapter",
        str(weights.parent),
        "--out",
        str(tmp_path / "e1"),
    ]
    assert main(argv) == 2
    assert "loca_adapter.safetensors: holds NaN" in capsys.readouterr().err
    # NaN weights: the metrics are printed, then refused, and no results file is written
    bad_model = tmp_path / "nan-model"
    model = tiny_model(tiny_tokenizer())
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    model.save_pretrained(bad_model)
    tiny_tokenizer().save_pretrained(bad_model)
    assert main([*ev, "--model", str(bad_model), "--out", str(tmp_path / "e2")]) == 2
    captured = capsys.readouterr()
    assert "test CE" in captured.out and "non-finite" in captured.err
    assert not (tmp_path / "e2" / "results.json").exists()


@pytest.mark.integration
def test_corrupt_artefacts_name_the_file(setup, tmp_path, capsys):
    root, common = setup
    fit = [
        "fit",
        *common,
        "--n-train",
        "8",
        "--n-heldout",
        "4",
        "--n-test",
        "4",
        "--max-iters",
        "1",
        "--quiet",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(fit) == 0
    (tmp_path / "run" / "adapter" / "loca_adapter.safetensors").write_bytes(b"not safetensors")
    cfg_path = tmp_path / "run" / "maps" / "feedback_config.json"
    cfg_path.write_text("{broken")
    ev = [
        "evaluate",
        "--model",
        str(root / "model"),
        "--task",
        str(root / "task.jsonl"),
        "--template",
        TEMPLATE,
        "--device",
        "cpu",
        "--n-test",
        "4",
        "--adapter",
        str(tmp_path / "run" / "adapter"),
        "--out",
        str(tmp_path / "ev"),
    ]
    capsys.readouterr()
    assert main(ev) == 2
    assert "loca_adapter.safetensors: not a readable safetensors file" in capsys.readouterr().err
    refit = [
        "fit",
        *common[:-2],
        "--n-train",
        "8",
        "--n-heldout",
        "4",
        "--n-test",
        "4",
        "--quiet",
        "--out",
        str(tmp_path / "run2"),
        "--maps",
        str(tmp_path / "run" / "maps"),
    ]
    assert main(refit) == 2
    assert "feedback_config.json: not readable JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--device", "gpu0"], "--device 'gpu0'"),
        (["--beta-rel", "inf"], "beta_rel"),
        (["--etas", "nan"], "etas"),
    ],
)
@pytest.mark.integration
def test_bad_flags_are_one_line_errors(setup, tmp_path, capsys, flags, needle):
    root, common = setup
    argv = [
        "fit",
        *common,
        "--n-train",
        "8",
        "--n-heldout",
        "4",
        "--n-test",
        "4",
        "--out",
        str(tmp_path / "x"),
        *flags,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.integration
def test_foreign_code_in_a_model_folder_is_never_run(setup, tmp_path, capsys):
    root, _ = setup
    folder = tmp_path / "remote"
    folder.mkdir()
    for f in (root / "model").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    sentinel = tmp_path / "ran"
    code = (
        f"open({str(sentinel)!r}, 'w').write('x')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    (folder / "evil.py").write_text(code)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(cfg))
    argv = [
        "evaluate",
        "--model",
        str(folder),
        "--task",
        str(root / "task.jsonl"),
        "--template",
        TEMPLATE,
        "--device",
        "cpu",
        "--n-test",
        "4",
        "--out",
        str(tmp_path / "ev"),
    ]
    assert main(argv) != 0
    assert not sentinel.exists()
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.integration
def test_debug_shows_the_traceback(setup, tmp_path):
    root, common = setup
    mine = user_folder(tmp_path / "mine")
    with pytest.raises(RunFolderError):
        main(["--debug", "fit", *common, "--out", str(mine)])


@pytest.mark.unit
def test_fingerprint_sees_a_change_in_any_weight(setup):
    from loca.models.parts import find_parts, fingerprint

    root, _ = setup
    model = tiny_model(tiny_tokenizer())
    parts = find_parts(model)
    before = fingerprint(parts)
    with torch.no_grad():  # a merged LoRA on one MLP projection: a dense low-rank change
        w = model.model.layers[0].mlp.down_proj.weight
        w += 1e-2 * torch.randn(w.shape[0], 1) @ torch.randn(1, w.shape[1])
    assert fingerprint(parts)["weights_sha256"] != before["weights_sha256"]
    assert fingerprint(find_parts(tiny_model(tiny_tokenizer()).to(torch.bfloat16))) == before


@pytest.mark.integration
def test_data_and_context_warnings(setup, tmp_path, capsys):
    root, common = setup

    def row(i):
        choices = {1: ["positive"], 2: ["negative", "negative"]}.get(i % 10, ["negative", "positive"])
        words = "w " * (60 if i % 10 == 3 else 2)
        return {"id": f"x{i}", "question": f"q{i % 30} {words}", "choices": choices, "label": 0}

    with open(tmp_path / "odd.jsonl", "w") as f:
        f.writelines(json.dumps(row(i)) + "\n" for i in range(80))
    argv = [
        "fit",
        *common[:2],
        "--task",
        str(tmp_path / "odd.jsonl"),
        "--template",
        "{question} ->",
        "--device",
        "cpu",
        "--rank",
        "4",
        "--feedback-rank",
        "4",
        "--n-train",
        "20",
        "--n-heldout",
        "10",
        "--n-test",
        "10",
        "--max-iters",
        "0",
        "--max-length",
        "999",
        "--quiet",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "exceeds the model's context of 256 tokens; using 256" in err
    assert "single choice" in err and "repeat a choice text" in err
    assert "same question and passage" in err
    assert "--max-iters 0 runs no Stage II iteration" not in err  # an info line: --quiet hides it
    assert "no --out given" in captured.out
    assert main(argv[:-1]) == 0
    assert "--max-iters 0 runs no Stage II iteration" in capsys.readouterr().err
    argv[argv.index("999")] = "24"  # the 60-word questions no longer fit
    assert main(argv) == 0
    assert "prompts were cut from the left" in capsys.readouterr().err


@pytest.mark.integration
def test_overwrite_never_replaces_a_users_file_of_the_same_name(setup, tmp_path, capsys):
    root, common = setup
    mine = user_folder(tmp_path / "mine")
    (mine / "config.json").write_text("my own config")
    argv = [
        "fit",
        *common,
        "--n-train",
        "8",
        "--n-heldout",
        "4",
        "--n-test",
        "4",
        "--max-iters",
        "1",
        "--quiet",
        "--overwrite",
        "--out",
        str(mine),
    ]
    assert main(argv) == 2 and "config.json" in capsys.readouterr().err
    assert (mine / "config.json").read_text() == "my own config"
    bench = ["bench", *common, "--n-train", "8", "--phases", ",", "--out", str(tmp_path / "b")]
    assert main(bench) == 2 and "names no phase" in capsys.readouterr().err


@pytest.mark.integration
def test_sigterm_leaves_a_consistent_best_snapshot(setup, tmp_path):
    """A real `loca fit` process killed mid-fit: the adapter on disk is a complete snapshot that
    loads and matches the model, and the run folder is still recognised as a fit run."""
    import signal
    import subprocess
    import sys
    import time

    from loca.method.adapters import ResidualAdapters
    from loca.models.parts import find_parts, load_model

    root, common = setup
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "loca",
        "fit",
        *common,
        "--n-train",
        "12",
        "--n-heldout",
        "6",
        "--n-test",
        "4",
        "--max-iters",
        "400",
        "--patience",
        "400",
        "--quiet",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    try:
        deadline = time.time() + 120
        while not (out / "adapter" / "loca_adapter.json").exists() and time.time() < deadline:
            assert proc.poll() is None, "loca fit ended before its first snapshot"
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143  # the CLI turns SIGTERM into an orderly stop
    model, _ = load_model(str(root / "model"), device="cpu")
    adapters = ResidualAdapters.from_pretrained(find_parts(model), out / "adapter")
    assert adapters.norm() > 0
    assert not list(out.glob(".adapter*")) and not list(out.glob(".*.tmp"))  # no temporaries left
    from loca.infra.runs import run_command

    assert run_command(out) == "fit"


@pytest.mark.integration
def test_flags_that_do_not_apply_are_refused(setup, tmp_path, capsys):
    root, common = setup
    argv = ["calibrate", *common, "--n-train", "8", "--n-heldout", "4", "--out", str(tmp_path / "m")]
    assert main(argv) == 2 and "--rank configure Stage II" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.integration
def test_a_full_disk_at_the_end_loses_no_metrics(setup, tmp_path, capsys, monkeypatch):
    """Writing results.json fails with ENOSPC (simulated): the metrics are on screen, the error is
    one line, and no partial file is left."""
    import errno

    import loca.cli.evaluate_command as ev_mod

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ev_mod, "atomic_write_json", full)
    root, _ = setup
    argv = [
        "evaluate",
        "--model",
        str(root / "model"),
        "--task",
        str(root / "task.jsonl"),
        "--template",
        TEMPLATE,
        "--device",
        "cpu",
        "--n-test",
        "4",
        "--out",
        str(tmp_path / "ev"),
    ]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "test CE" in captured.out and "acc" in captured.out
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "No space left" in errors[0] and "results.json" in errors[0]
    assert sorted(p.name for p in (tmp_path / "ev").iterdir()) == [".loca-run.json"]


@pytest.mark.integration
def test_a_single_test_example_has_undefined_standard_errors_not_an_error(setup, tmp_path):
    root, _ = setup
    argv = [
        "evaluate",
        "--model",
        str(root / "model"),
        "--task",
        str(root / "task.jsonl"),
        "--template",
        TEMPLATE,
        "--device",
        "cpu",
        "--n-test",
        "1",
        "--out",
        str(tmp_path / "ev"),
    ]
    assert main(argv) == 0
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert results["acc_stderr"] is None and results["test_ce"] > 0


@pytest.mark.integration
def test_a_failed_evaluation_leaves_the_model_without_adapters(tmp_path, monkeypatch):
    """Pipeline.run: if the test evaluation fails (here: refused metrics), the fitted adapters
    are detached before the error propagates; the best snapshot stays on disk."""
    from tiny import save_model_and_task

    import loca.pipeline
    from loca import DataConfig, LocaConfig, ModelConfig, Pipeline

    root = save_model_and_task(tmp_path, 60)

    def refuse(metrics, what):
        raise ValueError(f"{what}: refused")

    monkeypatch.setattr(loca.pipeline, "require_finite", refuse)
    pipe = Pipeline(
        ModelConfig(str(root / "model"), device="cpu"),
        DataConfig(str(root / "task.jsonl"), template=SENTIMENT_TEMPLATE, n_train=16, n_heldout=8, n_test=6),
        LocaConfig(rank=4, feedback_rank=4, max_iters=2),
        progress=False,
    )
    with pytest.raises(ValueError, match="refused"):
        pipe.run(tmp_path / "run")
    assert getattr(pipe.model, "_loca_adapters", None) is None
    assert (tmp_path / "run" / "adapter" / "loca_adapter.json").is_file()
    assert not (tmp_path / "run" / "results.json").exists()


# -- issue 22: foreign code through config files and run folders, limits, checkpoints, overwrite --


def loca_process(*argv: str, timeout: int = 300):
    """``python -m loca ARGV`` in a real subprocess (offline, this checkout's loca)."""
    import subprocess
    import sys
    from pathlib import Path

    import loca

    src = str(Path(loca.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "loca", *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def remote_code_model(root, folder):
    """A copy of the tiny model whose config points at its own code (``evil.py``), which would
    create the returned sentinel file if it ever ran."""
    folder.mkdir()
    for f in (root / "model").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    sentinel = folder.parent / f"{folder.name}-ran"
    code = (
        f"open({str(sentinel)!r}, 'w').write('x')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    (folder / "evil.py").write_text(code)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return sentinel


SMALL = ["--n-train", "8", "--n-heldout", "4", "--n-test", "4", "--quiet"]


@pytest.mark.integration
def test_trust_remote_code_is_never_taken_from_a_config_file_or_a_run_folder(setup, tmp_path):
    """`loca fit --config FILE` whose model section asks for trust_remote_code, and `loca fit
    --resume` on a run folder whose config.json does: refused in one line naming the flag; the
    model's code never runs (real processes)."""
    from loca import Pipeline

    root, common = setup
    folder = tmp_path / "remote"
    sentinel = remote_code_model(root, folder)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"model": str(folder), "trust_remote_code": True}}))
    task = common[common.index("--task") : common.index("--device")]
    done = loca_process(
        "fit", "--config", str(config), *task, "--device", "cpu", *SMALL, "--out", str(tmp_path / "a")
    )
    assert done.returncode == 2, done.stderr
    [line] = error_lines(done.stderr)
    assert str(config) in line and "pass --trust-remote-code" in line
    # someone else's run folder: an unfinished fit whose config.json asks for the model's code
    run = tmp_path / "theirs"
    run.mkdir()
    (run / MARKER).write_text(json.dumps({"command": "fit"}))
    record = {
        "command": "fit",
        "model": {"model": str(folder), "trust_remote_code": True},
        "loca": {"rank": 4},
    }
    (run / "config.json").write_text(json.dumps(record))
    done = loca_process("fit", "--resume", "--out", str(run), "--quiet")
    assert done.returncode == 2, done.stderr
    [line] = error_lines(done.stderr)
    assert str(run / "config.json") in line and "pass --trust-remote-code" in line
    assert not sentinel.exists()
    # the flag given again allows it (the API's argument likewise); nothing is loaded here
    assert Pipeline.from_run(run, trust_remote_code=True).model_config.trust_remote_code is True


@pytest.mark.integration
def test_a_rank_above_the_hidden_size_is_refused_before_any_work(setup, tmp_path):
    root, common = setup
    argv = [*common[: common.index("--rank")], "--rank", "1000", "--feedback-rank", "4"]
    done = loca_process("fit", *argv, *SMALL, "--out", str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr
    [line] = error_lines(done.stderr)
    assert "--rank 1000" in line and "hidden size 32" in line
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [MARKER]  # nothing written


def interrupted_fit(argv: list[str], after: int) -> None:
    """Run `loca fit ARGV` (in this process) and interrupt it like Ctrl-C once the fit state of
    iteration ``after`` is saved: the run folder then holds an unfinished run to resume."""
    from loca.run_folder import RunFolder

    real = RunFolder.checkpoint

    def stop(self, state):
        real(self, state)
        if state.iteration >= after:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunFolder, "checkpoint", stop)
        assert main(argv) == 130


def fit_argv(common, out, *extra):
    return [
        "fit",
        *common,
        *SMALL,
        "--max-iters",
        "6",
        "--patience",
        "6",
        "--etas",
        "0.3",
        *extra,
        "--out",
        str(out),
    ]


def snapshot(folder) -> dict:
    """Every file under ``folder`` (symbolic links as their targets), by relative path."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


@pytest.mark.integration
def test_a_truncated_fit_state_is_refused_naming_the_file_and_nothing_is_replaced(setup, tmp_path):
    """`fit --resume` on a run whose checkpoint/fit_state.json was cut short: one line naming the
    file (a real process); the adapter and history stay as they were, no restart from 0."""
    root, common = setup
    out = tmp_path / "run"
    interrupted_fit(fit_argv(common, out), after=3)
    state = out / "checkpoint" / "fit_state.json"
    text = state.read_text()
    state.write_text(text[: len(text) // 2])
    before = snapshot(out)
    done = loca_process("fit", "--resume", "--out", str(out), "--quiet")
    assert done.returncode == 2, done.stderr
    [line] = error_lines(done.stderr)
    assert str(state) in line and "not readable JSON" in line
    assert snapshot(out) == before and not (out / "results.json").exists()


def _partial(state):
    meta = json.loads(state.read_text())
    del meta["num_blocks"], meta["trajectories"]
    state.write_text(json.dumps(meta))


def _iteration(delta):
    def edit(state):
        meta = json.loads(state.read_text())
        meta["iteration"] += delta
        state.write_text(json.dumps(meta))

    return edit


def _cut_tensors(state):
    weights = state.parent / "fit_state.safetensors"
    weights.write_bytes(weights.read_bytes()[:-40])


def _nan_b(state):
    from safetensors.torch import load_file, save_file

    weights = state.parent / "fit_state.safetensors"
    tensors = load_file(weights)
    tensors["trajectory0.0"] = torch.full_like(tensors["trajectory0.0"], float("nan"))
    save_file(tensors, weights)


def _no_record(state):
    meta = json.loads(state.read_text())
    del meta["run"]
    state.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, names, needle",
    [
        (_partial, "fit_state.json", "missing or malformed num_blocks, trajectories"),
        (_iteration(-2), "fit_state.json", "its iteration (1) contradicts its history"),
        (_iteration(+2), "fit_state.json", "its iteration (5) contradicts its history"),
        (_cut_tensors, "fit_state.safetensors", "not a readable safetensors file"),
        (_nan_b, "fit_state.safetensors", "holds NaN/Inf"),
        (_no_record, "fit_state.json", "records no model, data and settings fingerprint"),
        (lambda s: shutil.rmtree(s.parent), "checkpoint", "the fit state was lost"),
        (
            lambda s: (s.parent.parent / "history.jsonl").write_text("{}\n"),
            "fit_state.json",
            "does not match",
        ),
    ],
    ids=[
        "partial-json",
        "iteration-lowered",
        "iteration-raised",
        "cut-tensors",
        "nan-b",
        "no-record",
        "lost",
        "history",
    ],
)
@pytest.mark.integration
def test_a_damaged_or_edited_fit_state_is_refused_naming_the_file(
    setup, tmp_path, capsys, damage, names, needle
):
    root, common = setup
    out = tmp_path / "run"
    interrupted_fit(fit_argv(common, out), after=3)
    damage(out / "checkpoint" / "fit_state.json")
    before = snapshot(out)
    capsys.readouterr()
    assert main(["fit", "--resume", "--out", str(out), "--quiet"]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert names in line and needle in line, line
    assert snapshot(out) == before and not (out / "results.json").exists()


@pytest.mark.integration
def test_a_fit_state_from_a_run_with_other_settings_is_refused(setup, tmp_path, capsys):
    root, common = setup
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    interrupted_fit(fit_argv(common, mine), after=3)
    interrupted_fit(fit_argv(common, theirs, "--beta-rel", "0.5"), after=3)
    shutil.rmtree(mine / "checkpoint")
    shutil.copytree(theirs / "checkpoint", mine / "checkpoint")
    capsys.readouterr()
    assert main(["fit", "--resume", "--out", str(mine), "--quiet"]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "checkpoint/fit_state.json" in line and "other LoCA settings" in line and "beta_rel" in line
    assert not (mine / "results.json").exists()


@pytest.mark.integration
def test_resuming_after_the_data_changed_is_refused(setup, tmp_path, capsys):
    """Labels flipped under an interrupted run (same ids): --resume refuses naming config.json, so
    results.json never sets the old data's frozen CE beside the new data's LoCA CE."""
    root, common = setup
    task = tmp_path / "task.jsonl"
    task.write_bytes((root / "task.jsonl").read_bytes())
    args = list(common)
    args[args.index("--task") + 1] = str(task)
    out = tmp_path / "run"
    interrupted_fit(fit_argv(args, out), after=2)
    rows = [json.loads(line) for line in task.read_text().splitlines()]
    task.write_text("".join(json.dumps({**r, "label": 1 - r["label"]}) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["fit", "--resume", "--out", str(out), "--quiet"]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert str(out / "config.json") in line and "data changed since this run started" in line
    assert not (out / "results.json").exists()
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))  # the data as they were: it resumes
    assert main(["fit", "--resume", "--out", str(out), "--quiet"]) == 0
    assert (out / "results.json").is_file() and not (out / "checkpoint").exists()


@pytest.mark.integration
def test_overwrite_replaces_the_earlier_run_only_once_the_new_one_has_finished(setup, tmp_path):
    """`fit --overwrite` over a finished run whose adapter/ is a symbolic link: a rerun that fails
    (a real process, NaN weights) leaves every file of the earlier run and the link as they were,
    and no staging folder; a rerun that succeeds replaces the run, removing the link but not its
    target."""
    root, common = setup
    out = tmp_path / "run"
    assert main(fit_argv(common, out)) == 0
    elsewhere = tmp_path / "kept" / "adapter"
    shutil.copytree(out / "adapter", elsewhere)
    shutil.rmtree(out / "adapter")
    (out / "adapter").symlink_to(elsewhere, target_is_directory=True)
    (out / "notes.txt").write_text("mine")
    before, kept = snapshot(out), snapshot(elsewhere)
    bad = tmp_path / "nan-model"
    model = tiny_model(tiny_tokenizer())
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    model.save_pretrained(bad)
    tiny_tokenizer().save_pretrained(bad)
    argv = fit_argv(["--model", str(bad), *common[2:]], out, "--overwrite")[1:]
    done = loca_process("fit", *argv)
    assert done.returncode != 0 and len(error_lines(done.stderr)) == 1, done.stderr
    assert snapshot(out) == before and snapshot(elsewhere) == kept
    assert main(fit_argv(common, out, "--overwrite", "--max-iters", "2")) == 0
    assert json.loads((out / "config.json").read_text())["loca"]["max_iters"] == 2
    assert (out / "adapter").is_dir() and not (out / "adapter").is_symlink()
    assert snapshot(elsewhere) == kept and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [MARKER]


@pytest.mark.integration
def test_an_interrupted_overwrite_leaves_the_earlier_run(setup, tmp_path):
    """Ctrl-C (or SIGTERM) during an --overwrite rerun: the earlier run is whole, the rerun's
    staging folder is gone."""
    root, common = setup
    out = tmp_path / "run"
    assert main(fit_argv(common, out)) == 0
    before = snapshot(out)
    interrupted_fit(fit_argv(common, out, "--overwrite", "--beta-rel", "0.5"), after=2)
    assert snapshot(out) == before


@pytest.mark.unit
def test_swap_in_puts_the_old_entries_back_if_a_rename_fails(tmp_path, monkeypatch):
    from loca.infra.io import swap_in

    into, new = tmp_path / "run", tmp_path / "run" / ".staging"
    new.mkdir(parents=True)
    for name, text in (("a", "old a"), ("b", "old b"), ("keep", "user")):
        (into / name).write_text(text)
    (new / "a").write_text("new a")  # the new run has no "b": it is removed on success
    real, calls = os.replace, {"n": 0}

    def failing(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:  # both old entries moved aside; the new one fails to move in
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(io_mod.os, "replace", failing)
    with pytest.raises(OSError, match="disk full"):
        swap_in(new, into, ("a", "b"))
    assert {p.name: p.read_text() for p in into.iterdir() if p.is_file()} == {
        "a": "old a",
        "b": "old b",
        "keep": "user",
    }
    monkeypatch.setattr(io_mod.os, "replace", real)
    swap_in(new, into, ("a", "b"))
    assert sorted(p.name for p in into.iterdir()) == ["a", "keep"] and (into / "a").read_text() == "new a"


@pytest.mark.integration
def test_a_truncated_model_safetensors_is_refused_naming_the_file(tmp_path, capsys):
    root = save_model_and_task(tmp_path, 10)
    weights = root / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code = main(
        [
            "fit",
            "--model",
            str(root / "model"),
            "--task",
            str(root / "task.jsonl"),
            "--template",
            "Q: {question}\nA:",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "run"),
            "--n-train",
            "4",
            "--n-heldout",
            "2",
            "--n-test",
            "2",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert code != 0 and str(weights) in err and "not a readable safetensors" in err
