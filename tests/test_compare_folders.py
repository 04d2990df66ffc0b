"""A comparison folder holds one comparison: another model's, sizes' or data's cells are refused
(``--overwrite`` replaces them), cells whose data changed under the same ids are recomputed,
``--report-only`` refuses mixed cells, one process at a time holds the folder, and a file under
``cells/`` that is not a cell is a one-line error naming it."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import save_tiny_model, tiny_model, tiny_tokenizer, write_sentiment_task

import loca
from loca.cli.main import main
from loca.compare.store import CellError, CellStore, read_cell
from loca.infra.runs import RunFolderError, RunLock

SIZES = ["--n-train", "8", "--n-heldout", "4", "--n-test", "6", "--batch-size", "8", "--quiet"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Two tiny models of one tokenizer (M1, M2: other weights) and an SST-2 folder."""
    root = tmp_path_factory.mktemp("folders")
    save_tiny_model(root / "m1")
    tok = tiny_tokenizer()
    tiny_model(tok, seed=1).save_pretrained(root / "m2")
    tok.save_pretrained(root / "m2")
    rng = random.Random(0)
    for split, n in (("train", 40), ("validation", 16)):
        write_sentiment_task(root / "data" / "sst2" / f"{split}.jsonl", n, rng, id_prefix=f"{split}-")
    return root


def compare(root, model: str, out, *extra: str) -> list[str]:
    return [
        "compare",
        "--model",
        str(root / model),
        "--data-dir",
        str(root / "data"),
        "--device",
        "cpu",
        "--tasks",
        "sst2",
        "--methods",
        "frozen",
        *SIZES,
        "--out",
        str(out),
        *extra,
    ]


def cell_files(out) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() for p in sorted((out / "cells").rglob("*.json"))}


def flip_labels(data, split: str) -> None:
    path = data / "sst2" / f"{split}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "label": 1 - r["label"]}) + "\n" for r in rows))


@pytest.mark.integration
def test_another_models_cells_are_refused_unless_overwrite(root, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(compare(root, "m1", out, "--seeds", "0", "1")) == 0
    before = cell_files(out)
    assert sorted(before) == ["cells/sst2/seed0/frozen.json", "cells/sst2/seed1/frozen.json"]
    launched = json.loads((out / "config.json").read_text())["distributed"]
    assert launched == {"world_size": 1, "backend": None, "devices": ["cpu"], "hosts": 1}
    capsys.readouterr()
    for model, extra, differ in (
        ("m2", [], "model"),  # another model: M1's cells would be replaced
        ("m1", ["--n-test", "4"], "sizes"),  # other sizes: not one table
        ("m1", ["--max-length", "64"], "evaluation"),
    ):
        assert main(compare(root, model, out, "--seeds", "0", *extra)) == 2
        err = capsys.readouterr().err
        assert f"holds 2 cell(s) of another comparison ({differ} " in err and "pass --overwrite" in err, err
        assert cell_files(out) == before  # nothing replaced
    m1_fingerprint = json.loads(before["cells/sst2/seed0/frozen.json"])["key"]["fingerprint"]
    # --overwrite: M2's cell replaces M1's; M1's seed-1 cell, which this run does not recompute, goes
    assert main(compare(root, "m2", out, "--seeds", "0", "--overwrite")) == 0
    after = cell_files(out)
    assert sorted(after) == ["cells/sst2/seed0/frozen.json"]
    assert json.loads(after["cells/sst2/seed0/frozen.json"])["key"]["fingerprint"] != m1_fingerprint
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["model"] for r in rows] == [str(root / "m2")]
    assert main(compare(root, "m2", out, "--seeds", "0")) == 0  # its own comparison: reused
    assert cell_files(out) == after


@pytest.mark.integration
def test_data_changed_under_the_same_ids_recomputes_its_cells(root, tmp_path, capsys):
    data = tmp_path / "data"
    for split in ("train", "validation"):
        (data / "sst2").mkdir(parents=True, exist_ok=True)
        (data / "sst2" / f"{split}.jsonl").write_text((root / "data" / "sst2" / f"{split}.jsonl").read_text())
    out = tmp_path / "cmp"
    argv = compare(root, "m1", out, "--seeds", "0", "1", "--data-dir", str(data))
    assert main(argv) == 0
    before = {k: json.loads(v) for k, v in cell_files(out).items()}
    flip_labels(data, "validation")  # the test labels flipped, the same ids
    capsys.readouterr()
    # seed 0 only: seed 1's cell, made from the old data, would stay beside seed 0's new one
    assert main([*argv[: argv.index("--seeds")], "--seeds", "0", "--data-dir", str(data)]) == 2
    assert "1 cell(s) made from other data than the task's files hold now" in capsys.readouterr().err
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "sst2 seed 0: the data changed since its cells were made" in log and "2 run, 0 reused" in log
    after = {k: json.loads(v) for k, v in cell_files(out).items()}
    for name, cell in after.items():
        old = before[name]
        assert cell["key"]["splits_sha256"] == old["key"]["splits_sha256"]  # the same ids and indices
        assert cell["key"]["data_sha256"]["test"] != old["key"]["data_sha256"]["test"]
        assert cell["key"]["data_sha256"]["train"] == old["key"]["data_sha256"]["train"]
        assert cell["test"]["acc"] == pytest.approx(1 - old["test"]["acc"])  # two choices, labels flipped
    assert main(argv) == 0 and "0 run, 2 reused" in capsys.readouterr().out


@pytest.mark.integration
def test_report_only_refuses_a_folder_of_mixed_cells(root, tmp_path, capsys):
    one, two = tmp_path / "m1", tmp_path / "m2"
    assert main(compare(root, "m1", one, "--seeds", "0", "1")) == 0
    assert main(compare(root, "m2", two, "--seeds", "0", "1")) == 0
    seed1 = one / "cells" / "sst2" / "seed1" / "frozen.json"
    seed1.write_text((two / "cells" / "sst2" / "seed1" / "frozen.json").read_text())  # M2's cell among M1's
    table = (one / "table.md").read_text()
    capsys.readouterr()
    assert main(["compare", "--out", str(one), "--report-only"]) == 2
    err = capsys.readouterr().err
    assert "mixes the cells of different comparisons (model " in err and "cells/sst2/seed1/frozen.json" in err
    assert (one / "table.md").read_text() == table  # the report is not redrawn


def _cell(task: str, seed: int, method: str, model: str = "tiny", data: str = "a") -> dict:
    return {
        "task": task,
        "seed": seed,
        "method": method,
        "device": "cpu",
        "peak_memory_mb": 1.0,
        "memory_kind": "rss",
        "wall_time_s": 1.0,
        "key": {
            "model": model,
            "sizes": {"n_train": 8, "n_heldout": 4, "n_test": 4},
            "data_sha256": {"train": data, "heldout": "h", "test": "t"},
        },
        "fit": {
            "heldout_ce": 3.0,
            "frozen_heldout_ce": 4.0,
            "selected": {},
            "best_step": 1,
            "step_unit": "step",
            "improved": True,
            "time_to_best_s": 0.5,
            "wall_time_s": 1.0,
            "history": [{"step": 0, "heldout_ce": 4.0, "elapsed_s": 0.0, "candidate": None}],
        },
        "test": {"test_ce": 3.0, "test_ce_no_eos": 3.0, "acc": 0.5, "acc_norm": 0.5},
    }


def _write(out, cell) -> None:
    path = out / "cells" / cell["task"] / f"seed{cell['seed']}" / f"{cell['method']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell))


@pytest.mark.unit
def test_mixed_cells_are_refused_for_the_report(tmp_path):
    _write(tmp_path / "ok", _cell("a", 0, "frozen"))
    _write(tmp_path / "ok", _cell("a", 0, "lora"))
    _write(tmp_path / "ok", _cell("b", 1, "lora", data="other"))  # another task: its own data
    assert len(CellStore(tmp_path / "ok").report_cells()) == 3
    _write(tmp_path / "model", _cell("a", 0, "frozen"))
    _write(tmp_path / "model", _cell("a", 1, "frozen", model="other"))
    with pytest.raises(ValueError, match="mixes the cells of different comparisons"):
        CellStore(tmp_path / "model").report_cells()
    _write(tmp_path / "data", _cell("a", 0, "frozen"))
    _write(tmp_path / "data", _cell("a", 0, "lora", data="b"))
    with pytest.raises(ValueError, match="the cells of task a seed 0 were made from different data"):
        CellStore(tmp_path / "data").report_cells()


@pytest.mark.integration
def test_malformed_cells_are_one_line_errors_naming_the_file(root, tmp_path, capsys):
    good = _cell("sst2", 0, "frozen")
    cases = {
        "[]": "holds a list, not a cell object",
        "{}": "has no 'task', 'seed'",
        "{not json": "not readable JSON",
        json.dumps({k: v for k, v in good.items() if k != "task"}): "has no 'task'",
        json.dumps({**good, "fit": []}): "its 'fit' is a list, not an object",
        json.dumps({**good, "test": {**good["test"], "acc": "high"}}): "its 'test' has a non-number 'acc'",
        json.dumps({**good, "method": "lora"}): "it is the cell of task 'sst2' seed 0 method 'lora'",
        json.dumps({**good, "fit": {**good["fit"], "history": [1]}}): "its fit's 'history' is not a list",
    }
    out = tmp_path / "cmp"
    path = out / "cells" / "sst2" / "seed0" / "frozen.json"
    path.parent.mkdir(parents=True)
    (out / ".loca-run.json").write_text('{"command": "compare"}')
    for text, problem in cases.items():
        path.write_text(text)
        with pytest.raises(CellError, match="not a `loca compare` cell"):
            read_cell(path)
        for argv in (
            ["compare", "--out", str(out), "--report-only"],
            compare(root, "m1", out, "--seeds", "0"),
        ):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1, err
            assert f"{path}: not a `loca compare` cell: {problem}" in err, err
            assert path.read_text() == text  # never replaced


@pytest.mark.integration
def test_one_process_at_a_time_holds_a_compare_folder(root, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(compare(root, "m1", out, "--seeds", "0")) == 0  # its lock is released on return
    RunLock(out, "compare").acquire().release()
    holder = subprocess.Popen(  # another process holds the folder's lock
        [
            sys.executable,
            "-c",
            "import sys, time; from loca.infra.runs import RunLock; "
            "RunLock(sys.argv[1], 'compare').acquire(); print('locked', flush=True); time.sleep(600)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(loca.__file__).parents[1])},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = cell_files(out)
        capsys.readouterr()
        for argv in (
            compare(root, "m1", out, "--seeds", "0", "1"),
            ["compare", "--out", str(out), "--report-only"],
        ):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert f"is in use by another `loca compare` (process {holder.pid} on " in err, err
        assert cell_files(out) == before
        with pytest.raises(RunFolderError, match="in use"):
            RunLock(out, "compare").acquire()
    finally:
        holder.kill()  # SIGKILL: the kernel releases its lock
        holder.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            RunLock(out, "compare").acquire().release()
            break
        except RunFolderError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert main(compare(root, "m1", out, "--seeds", "0", "1")) == 0
