"""`loca report` over real `loca fit` run folders of a tiny model: rows, trajectories, plots, errors."""

import json
import random
import shutil
import statistics

import pytest
from tiny import save_tiny_model, tiny_cli_args, write_sentiment_task

from loca.cli.main import main
from loca.eval.run_report import alignment_medians, read_run, read_runs, running_best, table_row, trajectories

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _json(path):
    return json.loads(path.read_text())


def _history(folder):
    return [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A fixed-η fit (two η, the alignment diagnostic on), an adaptive fit (two λ_rel), their report."""
    root = tmp_path_factory.mktemp("report")
    save_tiny_model(root / "model")
    write_sentiment_task(root / "task.jsonl", 40, random.Random(0))
    common = [
        "fit",
        *tiny_cli_args(root),
        "--n-train",
        "12",
        "--n-heldout",
        "6",
        "--n-test",
        "6",
        "--max-iters",
        "3",
        "--quiet",
    ]
    fixed, adaptive = root / "fixed", root / "adaptive"
    assert (
        main(
            [
                *common,
                "--step-control",
                "fixed",
                "--etas",
                "0.01",
                "0.03",
                "--alignment-every",
                "1",
                "--out",
                str(fixed),
            ]
        )
        == 0
    )
    assert (
        main([*common, "--step-control", "adaptive", "--lam-rel", "0.001", "0.01", "--out", str(adaptive)])
        == 0
    )
    out = root / "report"
    assert main(["report", str(fixed), str(adaptive), "--out", str(out)]) == 0
    return root, fixed, adaptive, out


def test_rows_match_each_runs_results(runs, capsys):
    root, fixed, adaptive, out = runs
    rows = _json(out / "report.json")["rows"]
    assert [r["run"] for r in rows] == ["fixed", "adaptive"]
    for row, folder in zip(rows, (fixed, adaptive), strict=True):
        res, cfg = _json(folder / "results.json"), _json(folder / "config.json")
        assert row["step_control"] == cfg["loca"]["step_control"] == folder.name
        assert (row["task"], row["model"]) == (res["task"], res["model"])
        assert row["eta"] == res["eta"] and row["lam_rel"] == res.get("lam_rel", res.get("lam"))
        assert row["best_iteration"] == res["best_iteration"] and row["improved"] == res["improved"]
        for side in ("frozen", "loca"):
            for m in ("heldout_ce", "test_ce", "test_acc"):
                assert row[f"{side}_{m}"] == res[side][m]
        assert row["delta_test_ce"] == pytest.approx(res["loca"]["test_ce"] - res["frozen"]["test_ce"])
        assert row["delta_test_acc"] == pytest.approx(res["loca"]["test_acc"] - res["frozen"]["test_acc"])
        for k in ("probe", "heldout", "random"):
            assert row[f"alignment_{k}"] == statistics.median(res["alignment"][k])
        assert row["fit_wall_time_s"] == res["fit_wall_time_s"]
    md = (out / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows)
    assert table[2].startswith("| fixed | ") and table[3].startswith("| adaptive | ")
    assert f"{rows[0]['frozen_test_ce']:.4f} → {rows[0]['loca_test_ce']:.4f}" in table[2]
    assert "](heldout_ce.png)" in md and "](alignment.png)" in md
    assert main(["report", str(fixed), "--out", str(root / "printed")]) == 0
    assert "| fixed | " in capsys.readouterr().out


def test_trajectories_follow_the_history(runs):
    _, fixed, adaptive, _ = runs
    history = _history(fixed)
    trajs = trajectories(history, "fixed")
    cfg = _json(fixed / "config.json")["loca"]
    assert len(trajs) == len(cfg["etas"]) * len(cfg["lam_rel"]) == 2
    for t in trajs:
        rows = [r for r in history if r.get("eta") == t.eta and r.get("lam_rel") == t.lam_rel]
        assert t.iterations == [r["iteration"] for r in rows] == [1, 2, 3]
        assert t.heldout_ce == [r["heldout_ce"] for r in rows] and t.accepted is None
    assert alignment_medians(history)[0] == [1, 2, 3]

    history = _history(adaptive)
    trajs = trajectories(history, "adaptive")
    assert [t.lam_rel for t in trajs] == _json(adaptive / "config.json")["loca"]["lam_rel"]
    frozen = history[0]["heldout_ce"]
    for t in trajs:
        rows = [r for r in history if r["lam_rel"] == t.lam_rel]
        assert t.eta is None and len(t.iterations) == len(rows)
        assert t.etas == [r["eta"] for r in rows] and t.accepted == [r["accepted"] for r in rows]
        best = running_best(t, frozen)
        assert best == sorted(best, reverse=True) and best[-1] == min([frozen, *t.heldout_ce])
    assert alignment_medians(history) == ([], [])


def test_plots_are_png_files_and_nothing_else_is_left(runs):
    out = runs[3]
    for name in ("heldout_ce.png", "alignment.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    names = {p.name for p in out.iterdir()}
    assert names == {".loca-run.json", "report.md", "report.json", "heldout_ce.png", "alignment.png"}


def test_older_results_and_alignment_from_the_maps(runs, tmp_path):
    run = shutil.copytree(runs[2], tmp_path / "adaptive")
    res = _json(run / "results.json")
    res["lam"] = res.pop("lam_rel")  # as written before results.json said lam_rel
    del res["alignment"]
    (run / "results.json").write_text(json.dumps(res))
    maps = _json(run / "maps" / "feedback_config.json")["alignment"]
    row = table_row(read_run(run))
    assert row["lam_rel"] == res["lam"] and row["alignment_probe"] == statistics.median(maps["probe"])
    assert [r.name for r in read_runs([run, runs[2]])] == [str(run), str(runs[2])]  # same folder name


def test_bad_run_folders_are_refused_naming_the_file(runs, tmp_path, capsys):
    root, fixed, _, _ = runs
    cases = {}
    for name, damage in (
        ("no-results", lambda d: (d / "results.json").unlink()),
        ("no-history", lambda d: (d / "history.jsonl").unlink()),
        ("bad-history", lambda d: (d / "history.jsonl").write_text('{"iteration": 0}\n{"iteration": 1,\n')),
        ("bad-results", lambda d: (d / "results.json").write_text("{")),
        ("compare", lambda d: (d / "config.json").write_text('{"command": "compare"}')),
    ):
        damage(shutil.copytree(fixed, tmp_path / name))
        cases[name] = tmp_path / name
    expected = {
        "no-results": r"results\.json is missing",
        "no-history": r"history\.jsonl is missing",
        "bad-history": r"history\.jsonl line 2 is not valid JSON",
        "bad-results": r"results\.json is not valid JSON",
        "compare": r"describes a `loca compare` run",
    }
    for name, pattern in expected.items():
        with pytest.raises(ValueError, match=pattern):
            read_run(cases[name])
    with pytest.raises(ValueError, match="names no command"):
        read_run(root / "model")  # a model folder: its config.json is not a run's
    with pytest.raises(ValueError, match="does not exist"):
        read_run(tmp_path / "nowhere")
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["report", str(fixed), str(cases["no-results"]), "--out", str(out)]) == 2
    assert "results.json is missing" in capsys.readouterr().err
    assert not out.exists()  # the inputs are read before --out is made


def test_out_folder_rules(runs, tmp_path):
    root, fixed, _, out = runs
    again = tmp_path / "again"
    assert main(["report", str(fixed), "--out", str(again)]) == 0
    assert main(["report", str(fixed), "--out", str(again)]) == 2
    assert main(["report", str(fixed), "--out", str(again), "--overwrite"]) == 0
    assert main(["report", str(fixed), "--out", str(fixed), "--overwrite"]) == 2  # a fit's folder
    assert _json(again / "report.json")["rows"][0]["run"] == "fixed"
