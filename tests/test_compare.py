"""`loca compare` end to end on a tiny saved model: every file, identical splits, recovery ratios,
and a resumed run that recomputes exactly the cells whose configuration changed."""

import csv
import json
import random
import shutil

import pytest
from tiny import save_tiny_model, write_sentiment_task

from loca.baselines.lora import LoraSettings
from loca.cli.args import dataclass_from_args
from loca.cli.main import main
from loca.compare import CompareSettings, MethodConfigs
from loca.config import LocaConfig
from loca.eval.metrics import recovery_ce

METHODS = ["frozen", "lora", "adapter-mezo", "loca", "mezo", "loca-abs"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    save_tiny_model(root / "model")
    rng = random.Random(0)
    for split, n in (("train", 80), ("validation", 30)):
        write_sentiment_task(root / "data" / "sst2" / f"{split}.jsonl", n, rng, id_prefix=f"{split}-")
    args = [
        "compare",
        "--model",
        str(root / "model"),
        "--data-dir",
        str(root / "data"),
        "--device",
        "cpu",
        "--tasks",
        "sst2",
        "--seeds",
        "0",
        "1",
        "--n-train",
        "24",
        "--n-heldout",
        "8",
        "--n-test",
        "12",
        "--rank",
        "4",
        "--feedback-rank",
        "4",
        "--max-iters",
        "2",
        "--etas",
        "0.01",
        "0.03",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lora-epochs",
        "2",
        "--lora-lrs",
        "1e-3",
        "--mezo-max-steps",
        "6",
        "--mezo-eval-every",
        "3",
        "--full-mezo-max-steps",
        "4",
        "--full-mezo-eval-every",
        "2",
        "--methods",
        *METHODS,
    ]
    return root, args


@pytest.mark.integration
def test_compare_writes_every_file_and_resumes(setup, capsys):
    root, args = setup
    out = root / "run"
    assert main([*args, "--out", str(out)]) == 0
    for name in (
        "config.json",
        "results.json",
        "results.csv",
        "table.md",
        "heldout_vs_time.png",
        "heldout_vs_steps.png",
        "accuracy.png",
    ):
        assert (out / name).is_file(), name
    cells = {p.stem: p for p in (out / "cells" / "sst2" / "seed0").glob("*.json")}
    assert sorted(cells) == sorted(METHODS)

    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == len(METHODS) * 2
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    for r in rows:
        assert {
            "test_ce",
            "test_ce_stderr",
            "acc",
            "acc_stderr",
            "acc_norm",
            "acc_norm_stderr",
            "best_step",
            "time_to_best_s",
            "fit_wall_time_s",
            "peak_memory_mb",
        } <= r.keys()
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


@pytest.mark.integration
def test_unknown_method_is_a_clear_error(setup, capsys):
    root, args = setup
    bad = [*args[: args.index("--methods")], "--methods", "frozen", "sgd"]
    assert main([*bad, "--out", str(root / "bad")]) == 2
    assert "unknown method" in capsys.readouterr().err


@pytest.mark.unit
def test_list_flags_take_commas_or_spaces():
    from loca.cli.args import config_from_args, dataclass_from_args
    from loca.cli.main import build_parser
    from loca.compare import CompareSettings

    args = build_parser().parse_args(
        ["compare", "--out", "x", "--methods", "frozen,lora", "loca", "--seeds", "0,1", "--etas", "0.01,0.03"]
    )
    settings = dataclass_from_args(CompareSettings, args)
    assert settings.methods == ["frozen", "lora", "loca"] and settings.seeds == [0, 1]
    assert config_from_args(args).etas == [0.01, 0.03]


@pytest.mark.integration
def test_loca_variants_run_as_extra_methods_with_an_ablation_table(setup, tmp_path):
    root, args = setup
    base = args[: args.index("--methods")]
    variants = json.dumps(
        {
            "paper": {"preset": "paper", "max_iters": 3},
            "adapt": {"step_control": "adaptive", "ridge_center": "previous"},
        }
    )
    out = tmp_path / "abl"
    run = [*base, "--seeds", "0", "--methods", "frozen", "lora", "loca", "--loca-variants", variants]
    assert main([*run, "--out", str(out)]) == 0
    cells = {p.stem for p in (out / "cells" / "sst2" / "seed0").glob("*.json")}
    assert cells == {"frozen", "lora", "loca", "loca@paper", "loca@adapt"}
    cfg = json.loads((out / "cells" / "sst2" / "seed0" / "loca@paper.json").read_text())["key"]["config"]
    assert cfg["etas"] == [0.01, 0.03] and cfg["rank"] == 4 and cfg["feedback_rank"] == 4  # the flags
    assert cfg["step_control"] == "fixed" and cfg["beta_rel"] == 1e-3  # the preset over the defaults
    assert cfg["max_iters"] == 3  # the variant over the flags (--max-iters 2)
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


@pytest.mark.unit
def test_loca_variant_precedence(tmp_path):
    """From the strongest: the variant's keys, the run's flags, the variant's preset, the run's
    --preset and --config, the defaults."""
    from loca.cli.compare_command import method_configs
    from loca.cli.main import build_parser
    from loca.compare.runner import _method_config

    def configs_of(*flags):
        args = build_parser().parse_args(["compare", "--out", "x", *flags])
        settings, configs = dataclass_from_args(CompareSettings, args), method_configs(args)
        return configs, lambda m: _method_config(m, configs, settings, 1, None)

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"loca": {"feedback_rank": 16, "probe_micro_batch": 4}}))
    variants = {
        "paper": {"preset": "paper"},
        "mine": {"preset": "paper", "max_iters": 7, "rank": 16},
        "plain": {"beta_rel": 2.0},
    }
    configs, cfg = configs_of(
        "--max-iters", "4", "--rank", "8", "--config", str(config), "--loca-variants", json.dumps(variants)
    )
    assert configs.loca_flags == {"max_iters", "rank"}
    assert (configs.loca.max_iters, configs.loca.feedback_rank, configs.loca.probe_micro_batch) == (4, 16, 4)
    paper = cfg("loca@paper")
    assert paper["max_iters"] == 4 and paper["rank"] == 8  # the run's flags over the variant's preset
    assert paper["feedback_rank"] == 8 and paper["step_control"] == "fixed"  # the preset over the file
    assert paper["probe_micro_batch"] == 4 and paper["seed"] == 1  # the file where the preset is silent
    mine = cfg("loca@mine")
    assert mine["max_iters"] == 7 and mine["rank"] == 16 and mine["feedback_rank"] == 8  # its keys first
    # without a preset a variant is the run's configuration with its keys
    assert cfg("loca@plain") == {**cfg("loca"), "beta_rel": 2.0}
    # the run's --preset is below the variant's preset, like its config file
    configs, cfg = configs_of(
        "--preset",
        "paper",
        "--feedback-rank",
        "4",
        "--loca-variants",
        '{"d": {"preset": "default"}, "p": {"preset": "paper"}}',
    )
    assert cfg("loca")["max_iters"] == 40 and cfg("loca@d") == cfg("loca")  # "default" adds nothing
    assert cfg("loca@p")["feedback_rank"] == 4


@pytest.mark.unit
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


@pytest.mark.integration
def test_yardsticks_run_end_to_end(setup):
    """lora-paper (the paper's LoRA protocol, last iterate) and both Adapter-BP credits as methods."""
    root, args = setup
    base = args[: args.index("--methods")]
    out = root / "yardsticks"
    methods = ["frozen", "lora-paper", "loca", "adapter-bp", "adapter-bp-predict"]
    run = [
        *base,
        "--seeds",
        "0",
        "--methods",
        *methods,
        "--adapter-bp-lrs",
        "1e-2",
        "--adapter-bp-epochs",
        "1",
        "--adapter-bp-eval-every",
        "1",
    ]
    assert main([*run, "--out", str(out)]) == 0
    cells = {p.stem: json.loads(p.read_text()) for p in (out / "cells" / "sst2" / "seed0").glob("*.json")}
    assert sorted(cells) == sorted(methods)
    paper = cells["lora-paper"]
    assert paper["key"]["config"]["lrs"] == [2e-4] and paper["key"]["config"]["epochs"] == 3
    assert paper["key"]["config"]["select"] is False and paper["key"]["config"]["rank"] == 4  # --lora-rank
    fit = paper["fit"]
    assert fit["method"] == "lora-paper" and fit["extra"]["last_iterate"] is True
    assert (
        fit["best_step"] == fit["history"][-1]["step"]
        and fit["heldout_ce"] == fit["history"][-1]["heldout_ce"]
    )
    for m, credit in (("adapter-bp", "all"), ("adapter-bp-predict", "predict")):
        cfg = cells[m]["key"]["config"]
        assert cfg["credit"] == credit and cfg["rank"] == 4 and cfg["seed"] == 0 and cfg["lrs"] == [1e-2]
        assert cells[m]["fit"]["method"] == m and cells[m]["fit"]["extra"]["credit"] == credit
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    f, lc, ceil = (rows[m]["test_ce"] for m in ("frozen", "loca", "adapter-bp-predict"))
    assert rows["loca"]["ceiling_method"] == "adapter-bp-predict"
    assert rows["loca"]["R_ceiling"] == recovery_ce(f, lc, ceil)
    assert rows["adapter-bp"]["R_ceiling"] is None and rows["lora-paper"]["R_ceiling"] is None
    table = (out / "table.md").read_text()  # no LoRA cell: R_ceiling without R_CE
    assert (
        "| Frozen | LoRA (paper) | LoCA | Adapter-BP | Adapter-BP (predict) | R_ceiling (LoCA vs "
        "Adapter-BP (predict)) |" in table
    )
    # LoRA's cell key has no `select` while it is the default: cells stored before it still match
    from loca.compare.runner import _method_config

    configs = MethodConfigs(loca=LocaConfig(), baselines={"lora": LoraSettings()})
    lora_key = _method_config("lora", configs, CompareSettings(), 0, None)
    assert "select" not in lora_key and LoraSettings(**lora_key) == LoraSettings()


@pytest.mark.unit
def test_every_place_that_names_a_method_reads_its_record():
    from loca.cli.compare_command import method_configs
    from loca.cli.main import build_parser
    from loca.compare.methods import CEILINGS, DEFAULT_METHODS, REGISTRY, baseline_options, get_method
    from loca.compare.plots import COLORS
    from loca.compare.report import LABELS, loca_like

    assert set(LABELS) == set(COLORS) == set(REGISTRY) == set(CompareSettings(methods=list(REGISTRY)).methods)
    assert LABELS["loca-abs"] == "LoCA (abs η)" and COLORS["adapter-bp-predict"] == "lightcoral"
    assert DEFAULT_METHODS == ["frozen", "lora", "loca", "adapter-mezo"] == CompareSettings().methods
    assert CEILINGS == ("adapter-bp-predict", "adapter-bp")  # predict first
    assert [m for m in REGISTRY if loca_like(m)] == ["loca", "loca-abs"] and loca_like("loca@x")
    assert not loca_like("sgd") and get_method("loca@x").run is REGISTRY["loca"].run
    with pytest.raises(ValueError, match="unknown method 'sgd'"):
        get_method("sgd")
    # one flag group per settings class a method names, in the methods' order
    assert [(o.prefix, o.title) for o in baseline_options()] == [
        ("lora", "LoRA"),
        ("adapter-bp", "Adapter-BP"),
        ("mezo", "Adapter-MeZO"),
        ("full-mezo", "full MeZO"),
    ]
    configs = method_configs(build_parser().parse_args(["compare", "--out", "x"]))  # the defaults
    assert configs.of(REGISTRY["lora"].options) == LoraSettings()
    assert set(configs.to_dict()) == {"loca", "lora", "adapter_bp", "adapter_mezo", "mezo"}


def _cell(task, seed, method, test_ce, acc=0.5):
    return {
        "task": task,
        "seed": seed,
        "method": method,
        "device": "cpu",
        "peak_memory_mb": 1.0,
        "memory_kind": "rss",
        "wall_time_s": 1.0,
        "key": {"model": "tiny", "sizes": {"n_train": 8, "n_heldout": 4, "n_test": 4}},
        "fit": {
            "heldout_ce": test_ce,
            "frozen_heldout_ce": 4.0,
            "selected": {},
            "best_step": 1,
            "step_unit": "step",
            "improved": True,
            "time_to_best_s": 0.5,
            "wall_time_s": 1.0,
            "history": [],
        },
        "test": {"test_ce": test_ce, "test_ce_no_eos": test_ce, "acc": acc, "acc_norm": acc},
    }


@pytest.mark.unit
def test_r_ceiling_on_hand_made_cells():
    from loca.compare.report import rows_from_cells, summarize, table_markdown

    ce = {
        ("a", 0): {
            "frozen": 4.0,
            "lora": 1.0,
            "adapter-bp": 2.0,
            "adapter-bp-predict": 3.0,
            "loca": 3.5,
            "loca-abs": 3.8,
            "loca@x": 3.0,
        },
        ("a", 1): {"frozen": 4.0, "lora": 1.0, "adapter-bp": 2.0, "loca": 3.0, "loca@x": 2.5},  # no predict
        ("a", 2): {"frozen": 4.0, "lora": 1.0, "loca": 3.0},  # no ceiling at all
        ("b", 0): {"frozen": 4.0, "lora": 1.0, "adapter-bp": 3.99, "loca": 3.0},  # a ceiling too small
    }
    cells = [_cell(t, s, m, v) for (t, s), ms in ce.items() for m, v in ms.items()]
    rows = {(r["task"], r["seed"], r["method"]): r for r in rows_from_cells(cells)}
    expect = {
        ("a", 0, "loca"): (0.5 / 1.0, "adapter-bp-predict"),  # predict preferred over all
        ("a", 0, "loca-abs"): (0.2 / 1.0, "adapter-bp-predict"),
        ("a", 0, "loca@x"): (1.0 / 1.0, "adapter-bp-predict"),
        ("a", 1, "loca"): (1.0 / 2.0, "adapter-bp"),
        ("a", 1, "loca@x"): (1.5 / 2.0, "adapter-bp"),
        ("a", 2, "loca"): (None, None),
        ("b", 0, "loca"): (None, "adapter-bp"),  # flagged like R_CE: the ceiling's gain is ~0
    }
    for k, (r, ref) in expect.items():
        got = rows[k]["R_ceiling"]
        assert (got is None if r is None else abs(got - r) < 1e-12) and rows[k]["ceiling_method"] == ref, k
        assert rows[k]["R_CE"] == recovery_ce(4.0, ce[k[:2]][k[2]], 1.0)
    for k, row in rows.items():  # only LoCA-like methods get one
        if not k[2].startswith("loca"):
            assert row["R_ceiling"] is None and row["ceiling_method"] is None
    summary = summarize(list(rows.values()))
    agg = summary["per_task"]["a"]["loca"]["R_ceiling"]
    assert agg["n"] == 2 and abs(agg["mean"] - 0.5) < 1e-12
    assert summary["loca_vs_lora"]["median_R_ceiling"] == 0.5
    assert summary["variants_vs_lora"]["loca@x"]["median_R_ceiling"] == 0.875
    table = table_markdown(list(rows.values()))
    header = next(
        line for line in table.splitlines() if line.startswith("| task | Frozen") and "R_CE" in line
    )
    # seeds of both kinds: the header names both, predict first
    assert header.endswith(
        "| R_CE (LoCA) | R_ceiling (LoCA vs Adapter-BP (predict) where it ran, else Adapter-BP) |"
    )
    row_a = next(line for line in table.splitlines() if line.startswith("| a |"))  # the test CE table
    assert row_a.endswith("| 0.50 ± 0.00 |")  # the 2 seeds with a ceiling (seed 2 has none: no "(2/3)")
    assert "median R_ceiling (vs Adapter-BP (predict) where it ran, else Adapter-BP)" in table


@pytest.mark.unit
def test_report_defects_of_issue_23():
    """The title names the methods that ran; R_acc over a one-item LoRA gain is flagged, not 6.00;
    the console line rounds the medians to 2 decimals."""
    from loca.compare.report import headline, rows_from_cells, summarize, table_markdown
    from loca.eval.metrics import RECOVERY_FLAG

    cells = []
    for seed, lora_acc in ((0, 0.71), (1, 0.74)):  # LoRA's gain: 1 item of 100, then 4
        for method, ce, acc in (("frozen", 4.0, 0.70), ("lora", 1.0, lora_acc), ("loca", 1.0149, 0.76)):
            cell = _cell("a", seed, method, ce, acc)
            cell["test"]["n_test"] = 100
            cells.append(cell)
    rows = rows_from_cells(cells)
    r_acc = {r["seed"]: r["R_acc"] for r in rows if r["method"] == "loca"}
    assert r_acc[0] is None and r_acc[1] == pytest.approx(1.5)  # 6 items / 1 item: flagged
    table = table_markdown(rows)
    assert table.splitlines()[0] == "# tiny: Frozen vs LoRA vs LoCA"  # no MeZO that did not run
    acc_row = [line for line in table.splitlines() if line.startswith("| a |")][2]  # the acc table
    assert acc_row.endswith("| 1.50 (1/2) |")
    head = summarize(rows)["loca_vs_lora"]
    assert head["median_R_CE"] == pytest.approx(0.9950333333)
    line = headline(head)
    assert line == "LoCA vs LoRA: CE below LoRA in 0/1 tasks, median R_CE 1.00, median R_acc 1.50"
    head["median_R_acc"] = None  # every seed flagged
    assert headline(head).endswith(f"median R_acc {RECOVERY_FLAG}")


@pytest.mark.unit
def test_the_steps_plot_draws_every_step_of_an_adaptive_trajectory():
    """Adaptive LoCA's η moves every step: its trajectory is its λ, so the steps plot shows all
    of its steps, not only the two taken at the selected η; a fixed-η fit keeps its (η, λ)."""
    from loca.compare.plots import _adaptive, _selected_curve

    etas = [0.01, 0.02, 0.01, 0.02, 0.04, 0.02]
    history = [{"candidate": None, "step": 0, "heldout_ce": 4.0}] + [
        {"candidate": {"eta": eta, "lam_rel": 0.001}, "step": i + 1, "heldout_ce": 3.0 - 0.1 * i}
        for i, eta in enumerate(etas)
    ]
    fit = {"selected": {"eta": 0.01, "lam_rel": 0.001}, "history": history}
    cell = {"key": {"config": {"step_control": "adaptive"}}}
    assert _adaptive(cell) and not _adaptive({"key": {"config": {"step_control": "fixed"}}})
    assert not _adaptive({"key": {}})
    assert _selected_curve(fit, adaptive=True)[0] == [0, 1, 2, 3, 4, 5, 6]
    assert _selected_curve(fit)[0] == [0, 1, 3]  # a fixed control's trajectory is its (η, λ)


@pytest.mark.unit
def test_compare_settings_are_frozen_once_resolved():
    import dataclasses

    settings = CompareSettings(methods=["frozen", "loca"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.n_train = 5
    assert dataclasses.replace(settings, n_train=5).n_train == 5 and settings.n_train == 1000


@pytest.mark.unit
def test_time_to_quality_is_the_first_evaluation_at_or_below_the_target():
    from loca.compare.report import time_to_reach

    history = [
        {"heldout_ce": 5.0, "elapsed_s": 1.0},
        {"heldout_ce": None, "elapsed_s": 2.0},  # a rejected, non-finite step
        {"heldout_ce": 0.9, "elapsed_s": 3.0},
        {"heldout_ce": 0.5, "elapsed_s": 4.0},
    ]
    assert time_to_reach(history, 1.0) == 3.0
    assert time_to_reach(history, 0.5) == 4.0
    assert time_to_reach(history, 0.4) is None
