"""Safety of a user's files and models: run folders, artefact folders, strict JSON, foreign code,
non-finite metrics and one-line errors."""

import json
import os
import random

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

import loca.io as io_mod
from loca.cli import main
from loca.io import FolderInUseError, atomic_dir, atomic_write_json
from loca.runs import MARKER, RunFolderError, prepare_run_dir

WORDS = "a charming and often affecting journey the of to is was b c d e f g h".split()
TEMPLATE = "Review: {question}\nSentiment (positive or negative):"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    tok = tiny_tokenizer()
    tiny_model(tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rng = random.Random(1)
    with open(root / "task.jsonl", "w") as f:
        for i in range(40):
            words = rng.choices(WORDS, k=rng.randint(3, 8))
            row = {"id": f"x{i}", "question": " ".join(words), "choices": ["negative", "positive"],
                   "label": int(words[0] in WORDS[:8])}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    common = ["--model", str(root / "model"), "--task", str(root / "task.jsonl"), "--template", TEMPLATE,
              "--device", "cpu", "--rank", "4", "--feedback-rank", "4"]  # fmt: skip
    return root, common


def user_folder(path):
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    return path


# -- artefact folders ---------------------------------------------------------------------------
def test_atomic_dir_never_replaces_a_folder_it_did_not_make(tmp_path):
    mine = user_folder(tmp_path / "mine")
    with pytest.raises(FolderInUseError, match="refusing to replace"):
        with atomic_dir(mine, "adapter_config.json", "loca-adapter") as tmp:
            (tmp / "x").write_text("new")
    assert (mine / "notes.txt").read_text() == "mine" and not (mine / "x").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # no temporary folder left behind


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


def test_json_is_strict(tmp_path):
    with pytest.raises(ValueError, match="non-finite"):
        atomic_write_json(tmp_path / "r.json", {"test_ce": float("nan")})
    assert not (tmp_path / "r.json").exists()


# -- run folders --------------------------------------------------------------------------------
def test_run_folder_rules(tmp_path, setup):
    root, _ = setup
    assert prepare_run_dir(tmp_path / "new", "fit").is_dir()
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
def test_a_read_only_out_fails_before_the_work(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(RunFolderError, match="cannot write"):
            prepare_run_dir(ro / "run", "fit")
    finally:
        ro.chmod(0o755)


def test_commands_refuse_user_folders_and_model_folders(setup, tmp_path, capsys):
    root, common = setup
    model_files = sorted(p.name for p in (root / "model").iterdir())
    mine = user_folder(tmp_path / "mine")
    small = ["--n-train", "8", "--n-heldout", "4", "--n-test", "4", "--max-iters", "1"]
    cases = [
        ["fit", *common, *small, "--out", str(mine)],
        ["fit", *common, *small, "--out", str(root / "model")],
        ["calibrate", *common, "--n-train", "8", "--n-heldout", "4", "--out", str(mine)],
        ["calibrate", *common, "--n-train", "8", "--n-heldout", "4", "--out", str(root / "model")],
        ["evaluate", "--model", str(root / "model"), "--task", str(root / "task.jsonl"),
         "--template", TEMPLATE, "--device", "cpu", "--out", str(mine)],
        ["bench", *common, "--n-train", "8", "--phases", "forward", "--out", str(mine)],
    ]  # fmt: skip
    for argv in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv[0]
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error:" in err, err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in (root / "model").iterdir()) == model_files


def test_rerunning_fit_needs_overwrite_and_evaluate_never_replaces_a_fit(setup, tmp_path, capsys):
    root, common = setup
    run = ["fit", *common, "--n-train", "8", "--n-heldout", "4", "--n-test", "4", "--max-iters", "1",
           "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(run) == 0
    before = (tmp_path / "run" / "results.json").read_text()
    assert main(run) == 2 and "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "run" / "results.json").read_text() == before
    ev = ["evaluate", "--model", str(root / "model"), "--task", str(root / "task.jsonl"),
          "--template", TEMPLATE, "--device", "cpu", "--n-test", "4",
          "--out", str(tmp_path / "run")]  # fmt: skip
    assert main([*ev, "--overwrite"]) == 2
    assert (tmp_path / "run" / "results.json").read_text() == before
    assert main([*run, "--overwrite"]) == 0


def test_non_finite_metrics_are_errors_and_nothing_is_written(setup, tmp_path, capsys):
    root, common = setup
    from safetensors.torch import load_file, save_file

    fit = ["fit", *common, "--n-train", "8", "--n-heldout", "4", "--n-test", "4", "--max-iters", "1",
           "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(fit) == 0
    weights = tmp_path / "run" / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors["B.0"] = torch.full_like(tensors["B.0"], float("nan"))
    save_file(tensors, weights)
    out = tmp_path / "eval"
    capsys.readouterr()
    argv = ["evaluate", "--model", str(root / "model"), "--task", str(root / "task.jsonl"), "--template",
            TEMPLATE, "--device", "cpu", "--n-test", "4", "--adapter", str(tmp_path / "run" / "adapter"),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "test CE" in captured.out and "non-finite" in captured.err  # printed first, then refused
    assert not (out / "results.json").exists()


def test_foreign_code_in_a_model_folder_is_never_run(setup, tmp_path, capsys):
    root, _ = setup
    folder = tmp_path / "remote"
    folder.mkdir()
    for f in (root / "model").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    sentinel = tmp_path / "ran"
    code = (f"open({str(sentinel)!r}, 'w').write('x')\n"
            "from transformers import PretrainedConfig\n"
            "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")  # fmt: skip
    (folder / "evil.py").write_text(code)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(cfg))
    argv = ["evaluate", "--model", str(folder), "--task", str(root / "task.jsonl"),
            "--template", TEMPLATE, "--device", "cpu", "--n-test", "4",
            "--out", str(tmp_path / "ev")]  # fmt: skip
    assert main(argv) != 0
    assert not sentinel.exists()
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_debug_shows_the_traceback(setup, tmp_path):
    root, common = setup
    mine = user_folder(tmp_path / "mine")
    with pytest.raises(RunFolderError):
        main(["--debug", "fit", *common, "--out", str(mine)])
