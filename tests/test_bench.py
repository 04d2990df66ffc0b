"""The benchmark's own sanity: a phase that allocates a known buffer shows it, phases do not see
each other's allocations, and every phase (the baselines included) runs on a tiny model."""

import json
import time

import pytest
import torch
from tiny import save_model_and_task, sequences, tiny_cli_args, tiny_parts

from loca.bench.measure import measure_phases
from loca.cli.main import main

MB = 2**20


@pytest.mark.unit
def test_a_known_allocation_shows_and_phases_are_isolated():
    held = []

    def big():  # 64 MB, touched, held for 50 ms (the sampler looks every 5 ms)
        x = torch.ones(64 * MB // 4)
        time.sleep(0.05)
        held.append(float(x.sum()))

    def small():
        held.append(float(torch.ones(1000).sum()))

    rows = {r.phase: r for r in measure_phases({"big": big, "small": small}, torch.device("cpu"), repeats=2)}
    assert 60 <= rows["big"].peak_mb <= 100, rows["big"]
    assert rows["small"].peak_mb < 8, rows["small"]  # the big phase's buffer is not counted again
    assert rows["big"].time_s > 0 and rows["small"].repeats == 2


@pytest.mark.integration
def test_every_phase_runs_and_the_table_has_its_ratios(tmp_path):
    root = save_model_and_task(tmp_path, 60)
    out = tmp_path / "bench"
    argv = [
        "bench",
        *tiny_cli_args(root),
        "--n-train",
        "16",
        "--phases",
        "forward-floor,forward,stage2,full-run,lora,adapter-mezo,mezo",
        "--repeats",
        "1",
        "--full-run-iters",
        "2",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    phases = ["forward-floor", "forward", "stage2", "full-run", "lora", "adapter-mezo", "mezo"]
    assert [r["phase"] for r in report["rows"]] == phases
    table = (out / "bench.md").read_text().splitlines()
    lora = next(line for line in table if line.startswith("| lora |"))
    stage2 = next(line for line in table if line.startswith("| stage2 |")).split(" | ")
    by = {r["phase"]: r for r in report["rows"]}
    assert float(stage2[2]) == round(by["stage2"]["time_s"] / by["forward-floor"]["time_s"], 2)
    assert float(stage2[3]) == round(by["stage2"]["time_s"] / by["lora"]["time_s"], 2)
    assert "stage2/forward-floor" in report["ratios"]
    assert "—" in lora  # LoRA against itself: no ratio


@pytest.mark.integration
def test_synthetic_lengths_give_batches_of_exactly_that_length(tmp_path):
    root = save_model_and_task(tmp_path, 10)  # the built-in task's data is never read
    out = tmp_path / "bench"
    argv = [
        "bench",
        "--model",
        str(root / "model"),
        "--task",
        "sst2",
        "--device",
        "cpu",
        "--rank",
        "4",
        "--feedback-rank",
        "4",
        "--n-train",
        "12",
        "--synthetic-length",
        "20",
        "--phases",
        "forward,stage2,stage2-eager",
        "--repeats",
        "1",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    setup = json.loads((out / "bench.json").read_text())["setup"]
    assert setup["tokens"] == 12 * 20 and setup["sequences"] == 12 and setup["synthetic_length"] == 20
    assert setup["predict_positions"] == 12 * 2  # the answer token and EOS


@pytest.mark.unit
def test_synthetic_items_are_seeded_and_sized():
    from loca.data.synthetic import synthetic_items

    a, b = synthetic_items(5, 9, 100, seed=3, eos_id=7), synthetic_items(5, 9, 100, seed=3, eos_id=7)
    assert a == b and all(len(x.ids) == 9 and x.completion[-1] == 7 and x.has_eos for x in a)
    assert synthetic_items(5, 9, 100, seed=4, eos_id=7) != a
    assert all(len(x.completion) == 1 for x in synthetic_items(2, 3, 100))


@pytest.mark.unit
def test_the_floor_forms_the_full_forwards_logits_at_the_predict_positions_only():
    from loca.bench.phases import predict_logits
    from loca.data.batching import make_batches

    model, parts = tiny_parts()
    batch = make_batches(sequences(6), 0, batch_size=6)[0]
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        floor = predict_logits(parts, batch)
    assert floor.shape == (len(batch.pos_b), full.shape[-1])
    torch.testing.assert_close(floor, full[batch.pos_b, batch.pos_t], rtol=1e-5, atol=1e-5)
