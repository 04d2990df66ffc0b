"""Stage II through CUDA graphs (``LocaConfig.cuda_graphs``) gives the eager pass's statistics,
follows B and the maps as they change, and fits like the eager fit (these run only where CUDA is:
the GPU machine). The graphs' length bucketing leaves the losses unchanged (CPU)."""

import random

import pytest
import torch
from tiny import SENTIMENT_TEMPLATE, save_tiny_model, write_sentiment_task

from loca.data.batching import Encoded, make_batches

pytestmark = pytest.mark.integration

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pipeline(tmp_path, dtype="float32", device="cuda", **cfg):
    from loca import DataConfig, LocaConfig, ModelConfig, Pipeline

    save_tiny_model(tmp_path / "model")
    write_sentiment_task(tmp_path / "task.jsonl", 80, random.Random(0))
    data = DataConfig(
        str(tmp_path / "task.jsonl"), template=SENTIMENT_TEMPLATE, n_train=30, n_heldout=10, n_test=12
    )
    config = LocaConfig(rank=4, feedback_rank=4, batch_size=8, **cfg)
    model = ModelConfig(str(tmp_path / "model"), device=device, dtype=dtype)
    return Pipeline(model, data, config, progress=False)


@needs_cuda
@pytest.mark.parametrize(
    "dtype, tol, gate", [("float32", 1e-5, "none"), ("bfloat16", 2e-2, "none"), ("float32", 1e-5, "role")]
)
def test_graphed_passes_equal_eager_and_follow_b_and_maps(tmp_path, dtype, tol, gate):
    from loca.eval.evaluation import completion_ce
    from loca.method.adapters import ResidualAdapters
    from loca.method.graphs import batch_graphs
    from loca.method.stage2 import collect_statistics

    pipe = pipeline(tmp_path, dtype, feedback_gate=gate)  # role: each position's map picked in the graph
    parts = pipe.parts
    train, heldout = pipe.batched()
    assert len(train) >= 3
    maps = pipe.calibrate()
    assert maps.gate == gate
    adapters = ResidualAdapters(parts, rank=pipe.cfg.rank).attach()
    graphs = batch_graphs(parts, adapters, train)
    heldout_graphs = batch_graphs(parts, adapters, heldout, graphs)
    gen = torch.Generator().manual_seed(0)
    blocks = list(range(parts.num_blocks))
    for step in range(4):  # B = 0, another B, new maps, B edited in place
        if step == 1:
            adapters.set_b([0.3 * torch.randn(b.shape, generator=gen) for b in adapters.B])
        if step == 2:
            for f in maps.factors:
                f.v.copy_(torch.linalg.qr(torch.randn(f.v.shape, generator=gen))[0].to(f.v))
        if step == 3:
            adapters.B[0].mul_(3.0)
        eager, ce_e = collect_statistics(parts, adapters, maps, train, blocks)
        graphed, ce_g = collect_statistics(parts, adapters, maps, train, blocks, graphs=graphs)
        assert ce_g.mean == pytest.approx(ce_e.mean, rel=tol), step
        held_e, held_g = completion_ce(parts, heldout), completion_ce(parts, heldout, heldout_graphs)
        assert held_g.mean == pytest.approx(held_e.mean, rel=tol), step
        for l in blocks:
            for got, want in ((graphed[l].gram, eager[l].gram), (graphed[l].cross, eager[l].cross)):
                assert (got - want).norm() <= tol * want.norm(), (step, l)
    assert len(graphs._graphs) == len(train)  # captured once per batch, replayed after
    adapters.detach()


@needs_cuda
def test_fit_with_graphs_matches_the_eager_fit(tmp_path):
    results = {}
    for graphs in (False, True):
        pipe = pipeline(tmp_path / str(graphs), max_iters=4, cuda_graphs=graphs)
        results[graphs] = pipe.run(tmp_path / f"run-{graphs}")
    eager, graphed = results[False], results[True]
    assert eager["best_iteration"] == graphed["best_iteration"] and eager["improved"]
    for key, value in eager["loca"].items():
        assert graphed["loca"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_prepared_batches_are_padded_and_give_the_same_losses(tmp_path):
    from loca.eval.evaluation import position_losses
    from loca.method.graphs import BUCKET, _prepared

    pipe = pipeline(tmp_path, device="cpu")
    for batch in pipe.batched()[0]:
        prepared = _prepared(batch, pipe.parts)
        width = prepared.input_ids.shape[1]
        assert width % BUCKET == 0 and width > batch.input_ids.shape[1]
        assert int(prepared.attention_mask.sum()) == int(batch.attention_mask.sum())
        torch.testing.assert_close(position_losses(pipe.parts, prepared), position_losses(pipe.parts, batch))
    # one sequence of exactly BUCKET tokens: no padding, hence no mask
    one = make_batches([Encoded(tuple(range(5, 5 + BUCKET - 1)), (7,))], pad_id=0)[0]
    assert _prepared(one, pipe.parts).attention_mask is None
    torch.testing.assert_close(
        position_losses(pipe.parts, _prepared(one, pipe.parts)), position_losses(pipe.parts, one)
    )
