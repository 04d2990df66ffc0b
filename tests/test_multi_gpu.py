"""A model spread over two GPUs (``device_map``): blocks, adapters, statistics and recorded
positions on each block's device, the head error on the head's. Runs only where two CUDA devices
are (the GPU machine); calibration and fit agree with the same model on one GPU."""

import random

import pytest
import torch
from tiny import SENTIMENT_TEMPLATE, save_tiny_model, write_sentiment_task

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
    ),
]


def test_a_model_spread_over_two_gpus_fits_like_one(tmp_path):
    from accelerate import dispatch_model

    from loca import DataConfig, LocaConfig, ModelConfig, Pipeline
    from loca.models.parts import load_model

    save_tiny_model(tmp_path / "model")
    write_sentiment_task(tmp_path / "task.jsonl", 80, random.Random(0))
    data = DataConfig(
        str(tmp_path / "task.jsonl"), template=SENTIMENT_TEMPLATE, n_train=24, n_heldout=10, n_test=12
    )
    cfg = LocaConfig(rank=4, feedback_rank=4, max_iters=4, step_control="fixed", etas=[0.01, 0.03])
    results = {}
    for name, placement in (("one", None), ("two", "split")):
        model, tok = load_model(str(tmp_path / "model"), device="cuda:0")
        if placement:  # blocks 0 | 1 on two GPUs, the head with the last block
            model.cpu()
            device_map = {
                "model.embed_tokens": 0,
                "model.rotary_emb": 0,
                "model.layers.0": 0,
                "model.layers.1": 1,
                "model.norm": 1,
                "lm_head": 1,
            }
            model = dispatch_model(model, device_map=device_map)
        pipe = Pipeline(
            ModelConfig(str(tmp_path / "model")), data, cfg, progress=False, model_object=model, tokenizer=tok
        )
        if placement:
            assert [d.index for d in pipe.parts.block_devices()] == [0, 1] and pipe.parts.device.index == 1
        results[name] = pipe.run(tmp_path / name)
    one, two = results["one"], results["two"]
    assert one["best_iteration"] == two["best_iteration"] and one["eta"] == two["eta"] and one["improved"]
    for part in ("frozen", "loca"):
        for key, value in one[part].items():
            assert two[part][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (part, key)
