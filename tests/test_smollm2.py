"""End-to-end on the real SmolLM2-135M-Instruct and the local SST-2 copy (slow: real weights)."""

from pathlib import Path

import pytest

from loca.config import LocaConfig
from loca.data import encode_examples, get_task, load_splits
from loca.data.batching import make_batches, pad_token_id
from loca.method.calibrate import calibrate
from loca.method.fit import fit
from loca.method.probe import select_probe
from loca.models.parts import find_parts

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not (DATA / "sst2").is_dir(), reason="../shared/data is not beside the checkout"),
]


def test_calibration_aligns_and_loca_beats_the_frozen_model(smollm2):
    model, tokenizer = smollm2
    parts = find_parts(model)
    task = get_task("sst2")
    splits = load_splits(task, n_train=64, n_heldout=32, n_test=0, seed=0, data_dir=DATA)
    pad = pad_token_id(tokenizer)
    train_items = encode_examples(tokenizer, task, splits.train, max_length=256, add_eos=True)
    heldout_items = encode_examples(tokenizer, task, splits.heldout, max_length=256, add_eos=True)
    probe = select_probe(train_items, 1000, seed=0)
    maps = calibrate(
        parts, probe, heldout_items[:16], feedback_rank=8, beta_rel=1e-3, probe_micro_batch=16, pad_id=pad
    )
    align = maps.meta["alignment"]
    positive = sum(a > 0 for a in align["probe"])
    assert positive >= 0.8 * parts.num_blocks
    assert min(align["probe"]) > 5 * max(abs(r) for r in align["random"])
    assert sum(align["heldout"]) > 0

    train = make_batches(train_items, pad, batch_size=32)
    heldout = make_batches(heldout_items, pad, batch_size=32)
    result = fit(parts, maps, train, heldout, LocaConfig(etas=[0.003], max_iters=2), progress=False)
    try:
        assert result.improved
        assert result.heldout_ce < 0.8 * result.frozen_heldout_ce
    finally:
        result.adapters.detach()
