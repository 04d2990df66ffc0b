"""`loca compare` end to end on a tiny saved model: every file, identical splits, recovery ratios,
and a resumed run that recomputes exactly the cells whose configuration changed."""

import csv
import json
import random
import shutil

import pytest
from tiny import save_tiny_model, write_sentiment_task

from loca.cli import main
from loca.metrics import recovery_ce

METHODS = ["frozen", "lora", "adapter-mezo", "loca", "mezo", "loca-abs"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    save_tiny_model(root / "model")
    rng = random.Random(0)
    for split, n in (("train", 80), ("validation", 30)):
        write_sentiment_task(root / "data" / "sst2" / f"{split}.jsonl", n, rng, id_prefix=f"{split}-")
    args = [
        "compare", "--model", str(root / "model"), "--data-dir", str(root / "data"), "--device", "cpu",
        "--tasks", "sst2", "--seeds", "0", "1", "--n-train", "24", "--n-heldout", "8", "--n-test", "12",
        "--rank", "4", "--feedback-rank", "4", "--max-iters", "2", "--etas", "0.01", "0.03",
        "--lora-rank", "4", "--lora-alpha", "8", "--lora-epochs", "2", "--lora-lrs", "1e-3",
        "--mezo-max-steps", "6", "--mezo-eval-every", "3", "--full-mezo-max-steps", "4",
        "--full-mezo-eval-every", "2", "--methods", *METHODS,
    ]  # fmt: skip
    return root, args


def test_compare_writes_every_file_and_resumes(setup, capsys):
    root, args = setup
    out = root / "run"
    assert main([*args, "--out", str(out)]) == 0
    for name in ("config.json", "results.json", "results.csv", "table.md", "heldout_vs_time.png",
                 "heldout_vs_steps.png", "accuracy.png"):  # fmt: skip
        assert (out / name).is_file(), name
    cells = {p.stem: p for p in (out / "cells" / "sst2" / "seed0").glob("*.json")}
    assert sorted(cells) == sorted(METHODS)

    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == len(METHODS) * 2
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    for r in rows:
        assert {"test_ce", "test_ce_stderr", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr",
                "best_step", "time_to_best_s", "fit_wall_time_s", "peak_memory_mb"} <= r.keys()  # fmt: skip
    # every method of a seed ran on the same splits
    keys = [json.loads(p.read_text())["key"] for p in cells.values()]
    assert len({k["splits_sha256"] for k in keys}) == 1
    # R_CE against the same seed's LoRA
    by = {(r["seed"], r["method"]): r for r in rows}
    for seed in (0, 1):
        f, lo, lc = (by[(seed, m)]["test_ce"] for m in ("frozen", "lora", "loca"))
        assert by[(seed, "loca")]["R_CE"] == recovery_ce(f, lc, lo)
    # the 'auto' MeZO budget is LoCA's wall time in the same cell
    mezo_key = json.loads(cells["adapter-mezo"].read_text())["key"]
    loca_cell = json.loads(cells["loca"].read_text())
    assert mezo_key["config"]["time_budget_s"] == loca_cell["fit"]["wall_time_s"]
    assert "| sst2 |" in (out / "table.md").read_text()

    # resume: nothing recomputed
    mtimes = {m: p.stat().st_mtime_ns for m, p in cells.items()}
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 0
    log = capsys.readouterr().out
    assert "0 run, 12 reused" in log
    assert {m: p.stat().st_mtime_ns for m, p in cells.items()} == mtimes

    # a changed LoRA setting recomputes the LoRA cells only
    changed = [a if a != "1e-3" else "2e-3" for a in args]
    assert main([*changed, "--out", str(out)]) == 0
    assert "2 run, 10 reused" in capsys.readouterr().out
    new = {m: p.stat().st_mtime_ns for m, p in cells.items()}
    assert [m for m in METHODS if new[m] != mtimes[m]] == ["lora"]

    # the report can be redrawn from the cells alone
    (out / "table.md").unlink()
    assert main(["compare", "--out", str(out), "--report-only"]) == 0
    assert (out / "table.md").is_file()


def test_unknown_method_is_a_clear_error(setup, capsys):
    root, args = setup
    bad = [*args[: args.index("--methods")], "--methods", "frozen", "sgd"]
    assert main([*bad, "--out", str(root / "bad")]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_list_flags_take_commas_or_spaces():
    from loca.cli import build_parser
    from loca.compare import CompareSettings
    from loca.recipes.common import config_from_args, dataclass_from_args

    args = build_parser().parse_args(
        ["compare", "--out", "x", "--methods", "frozen,lora", "loca", "--seeds", "0,1", "--etas", "0.01,0.03"]
    )
    settings = dataclass_from_args(CompareSettings, args)
    assert settings.methods == ["frozen", "lora", "loca"] and settings.seeds == [0, 1]
    assert config_from_args(args).etas == [0.01, 0.03]


def test_loca_variants_run_as_extra_methods_with_an_ablation_table(setup, tmp_path):
    root, args = setup
    base = args[: args.index("--methods")]
    variants = json.dumps({"paper": {"preset": "paper", "max_iters": 2, "feedback_rank": 4},
                           "adapt": {"step_control": "adaptive", "ridge_center": "previous"}})  # fmt: skip
    out = tmp_path / "abl"
    run = [*base, "--seeds", "0", "--methods", "frozen", "lora", "loca", "--loca-variants", variants]
    assert main([*run, "--out", str(out)]) == 0
    cells = {p.stem for p in (out / "cells" / "sst2" / "seed0").glob("*.json")}
    assert cells == {"frozen", "lora", "loca", "loca@paper", "loca@adapt"}
    cfg = json.loads((out / "cells" / "sst2" / "seed0" / "loca@paper.json").read_text())["key"]["config"]
    assert cfg["etas"] == [0.003, 0.01, 0.03] and cfg["rank"] == 32  # the preset over the flags
    assert cfg["feedback_rank"] == 4 and cfg["max_iters"] == 2  # the variant over the preset
    table = (out / "table.md").read_text()
    assert "| loca@adapt |" in table and "median R_CE" in table
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert set(summary["variants_vs_lora"]) == {"loca@paper", "loca@adapt"}
    merged = tmp_path / "merged"  # cells merged from several runs: no run marker, still a report
    shutil.copytree(out / "cells", merged / "cells")
    assert main(["compare", "--out", str(merged), "--report-only"]) == 0
    assert (merged / "table.md").read_text() == table
    with pytest.raises(ValueError, match="unknown LoCA setting"):
        from loca.compare import CompareSettings

        CompareSettings(loca_variants='{"x": {"learning_rate": 1}}')


def test_loca_variants_file_is_read_once(tmp_path):
    from loca.compare import CompareSettings

    path = tmp_path / "variants.json"
    path.write_text('{"wide": {"beta_rel": 1.0}}')
    settings = CompareSettings(loca_variants=str(path))
    path.write_text('{"other": {"beta_rel": 2.0}}')  # edited while a long comparison runs
    assert settings.variants() == {"wide": {"beta_rel": 1.0}}
    path.unlink()
    with pytest.raises(ValueError, match="cannot read"):
        CompareSettings(loca_variants=str(path))
