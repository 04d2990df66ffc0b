"""Data parallelism on the CPU: ``loca fit`` under ``torchrun`` with two Gloo processes gives the
adapters, selection and metrics of one process (float64 statistics summed in another order:
equal to float32 rounding), and only rank 0 writes."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import SENTIMENT_TEMPLATE, save_model_and_task, save_tiny_model, tiny_cli_args, write_sentiment_task

pytestmark = pytest.mark.integration

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_model_and_task(tmp_path_factory.mktemp("dp"), 80)


def run(root, out, nproc: int, *extra: str) -> None:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    argv = [
        *(launch if nproc > 1 else [sys.executable]),
        "-m",
        "loca",
        "fit",
        *tiny_cli_args(root),
        "--n-train",
        "24",
        "--n-heldout",
        "10",
        "--n-test",
        "12",
        "--batch-size",
        "4",
        "--probe-micro-batch",
        "3",
        "--probe-positions",
        "40",
        "--quiet",
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "extra",
    [
        ["--max-iters", "4"],
        ["--max-iters", "3", "--step-control", "fixed", "--groups", "2"],
        ["--max-iters", "3", "--probe-synthetic", "2", "--feedback-gate", "role"],
    ],
    ids=["adaptive", "fixed-gauss-seidel", "synthetic-errors-role-gate"],
)
def test_two_gloo_processes_fit_what_one_process_fits(root, tmp_path, extra):
    one, two = tmp_path / "one", tmp_path / "two"
    run(root, one, 1, *extra)
    run(root, two, 2, *extra)
    r1, r2 = (json.loads((d / "results.json").read_text()) for d in (one, two))
    for key in ("best_iteration", "eta", "improved"):
        assert r1[key] == r2[key]
    assert r1["improved"]
    for part in ("frozen", "loca"):
        for key, value in r1[part].items():
            assert r2[part][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (part, key)
    m1, m2 = (load_file(str(d / "maps" / "feedback_maps.safetensors")) for d in (one, two))
    for k in m1:  # the probe is gathered in the one-process order: the same maps
        torch.testing.assert_close(m2[k], m1[k], rtol=1e-5, atol=1e-7)
    a1, a2 = (load_file(str(d / "adapter" / "loca_adapter.safetensors")) for d in (one, two))
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], rtol=1e-4, atol=1e-6 * float(a1[k].abs().max()))
    names = sorted(p.name for p in two.iterdir())
    assert names == sorted(p.name for p in one.iterdir())  # rank 1 wrote nothing extra


def _leave() -> None:
    """Leave the process group once every rank is done: a rank that tears its gloo connections
    down while a peer still uses them can abort that peer at exit."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _dp_setup(rank: int, world: int, store: str):
    """One rank's process group, tiny float64 model, calibrated maps and batches."""
    import torch.distributed as dist
    from tiny import sequences, tiny_parts

    from loca.config import LocaConfig
    from loca.data.batching import make_batches
    from loca.method.calibrate import Calibrator

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    _, parts = tiny_parts(hidden=32, layers=3)
    train_items, heldout_items = sequences(40, seed=0), sequences(20, seed=100)
    cfg = LocaConfig(
        rank=8,
        feedback_rank=8,
        probe_positions=60,
        probe_micro_batch=5,
        max_iters=4,
        step_control="fixed",
        etas=[0.02, 0.1],
        batch_size=6,
    )
    cal = Calibrator(parts, train_items, heldout_items, cfg, pad_id=0)
    maps = cal.refit()
    train, heldout = make_batches(train_items, 0, 6), make_batches(heldout_items, 0, 6)
    return parts, cal, maps, train, heldout, cfg


def _worker(rank: int, world: int, store: str, result_file: str) -> None:
    """One rank: calibrate and fit a float64 tiny model on the shared data; rank 0 saves B."""

    from loca.eval.evaluation import completion_ce
    from loca.method.a_init import principal_a
    from loca.method.fit import fit

    parts, _, maps, train, heldout, cfg = _dp_setup(rank, world, store)
    res = fit(parts, maps, train, heldout, cfg, progress=False)
    out = {
        "b": res.adapters.get_b(),
        "us": [f.us for f in maps.factors],
        "ce": res.heldout_ce,
        "frozen": res.frozen_heldout_ce,
        "it": res.best_iteration,
        "eta": res.eta,
        "heldout_ce": completion_ce(parts, heldout).mean,
        "sketch_a": principal_a(parts, train, rank=2, seed=0),
    }
    res.adapters.detach()
    if rank == 0:
        torch.save(out, result_file)
    if world > 1:
        _leave()


def test_data_parallel_fit_equals_one_process_in_float64(tmp_path):
    import torch.multiprocessing as mp

    _worker(0, 1, "", str(tmp_path / "one.pt"))
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "two.pt")), nprocs=2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (one["it"], one["eta"]) == (two["it"], two["eta"]) and one["it"] > 0
    for key in ("ce", "frozen", "heldout_ce"):
        assert two[key] == pytest.approx(one[key], rel=1e-12)
    for a, b in zip(one["us"], two["us"], strict=True):  # probe rows gathered in order: the same maps
        assert torch.equal(a, b)
    for a, b in zip(one["b"], two["b"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)  # B is float32; the sums are float64
    for a, b in zip(one["sketch_a"], two["sketch_a"], strict=True):  # top-2 directions: one subspace
        torch.testing.assert_close(b.double().T @ b.double(), a.double().T @ a.double(), rtol=0, atol=1e-5)


def test_compare_under_torchrun_matches_one_process(tmp_path):
    """Every method on two Gloo ranks: LoCA data-parallel, LoRA and MeZO replicated, MeZO's
    'auto' time budget decided by rank 0's clock (a per-rank clock would desynchronise the ranks)."""
    save_tiny_model(tmp_path / "model")
    rng = random.Random(0)
    for split, n in (("train", 60), ("validation", 20)):
        write_sentiment_task(tmp_path / "data" / "sst2" / f"{split}.jsonl", n, rng, id_prefix=f"{split}-")
    args = [
        "-m",
        "loca",
        "compare",
        "--model",
        str(tmp_path / "model"),
        "--data-dir",
        str(tmp_path / "data"),
        "--device",
        "cpu",
        "--tasks",
        "sst2",
        "--seeds",
        "0",
        "--n-train",
        "16",
        "--n-heldout",
        "8",
        "--n-test",
        "10",
        "--rank",
        "4",
        "--feedback-rank",
        "4",
        "--max-iters",
        "2",
        "--batch-size",
        "4",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lora-epochs",
        "1",
        "--lora-lrs",
        "1e-3",
        "--mezo-max-steps",
        "4",
        "--mezo-eval-every",
        "2",
        "--methods",
        "frozen",
        "lora",
        "loca",
        "adapter-mezo",
        "--quiet",
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for argv, out in (([sys.executable], "one"), (launch, "two")):
        proc = subprocess.run(
            [*argv, *args, "--out", str(tmp_path / out)], env=ENV, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    launched = json.loads((tmp_path / "two" / "config.json").read_text())["distributed"]
    assert launched == {"world_size": 2, "backend": "gloo", "devices": ["cpu", "cpu"], "hosts": 1}
    rows = {}
    for out in ("one", "two"):
        for r in json.loads((tmp_path / out / "results.json").read_text())["rows"]:
            rows[(out, r["method"])] = r
    for method in ("frozen", "lora", "loca"):
        one, two = rows[("one", method)], rows[("two", method)]
        for key in ("test_ce", "acc", "heldout_ce"):
            assert two[key] == pytest.approx(one[key], rel=1e-5), (method, key)
    assert rows[("two", "adapter-mezo")]["test_ce"] > 0  # ran (its step count follows rank 0's clock)


def _sum_worker(rank: int, world: int, store: str, result_file: str) -> None:
    import torch.distributed as dist

    from loca.infra import distributed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1]
    gen = torch.Generator().manual_seed(rank)
    tensors = [
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen),
        torch.randn(2, 2, 2, generator=gen, dtype=torch.float64)[:, 0],  # a strided view
        torch.randn(distributed.FLAT_BYTES // 8 + 1, generator=gen, dtype=torch.float64),
    ]
    sent = [t.clone() for t in tensors]
    distributed.all_reduce_sum(*tensors)
    dist.all_reduce = real
    gathered = [None] * world
    dist.all_gather_object(gathered, sent)
    if rank == 0:
        torch.save({"calls": calls, "got": tensors, "sent": gathered}, result_file)
    _leave()


def test_all_reduce_sum_packs_small_tensors_into_one_collective(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_sum_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "sum.pt")), nprocs=2)
    out = torch.load(tmp_path / "sum.pt")
    # the two small float64 tensors share one buffer; float32 and the large tensor go alone
    assert sorted(out["calls"]) == sorted([12 + 4, 5, out["got"][3].numel()])
    for i, got in enumerate(out["got"]):
        want = out["sent"][0][i] + out["sent"][1][i]
        assert got.dtype == want.dtype and torch.equal(got, want)


class _Stop(Exception):
    pass


def _resume_worker(rank: int, world: int, store: str, folder: str) -> None:
    """Two ranks: a whole fit; then a fit stopped after iteration 2 (rank 0 writes the state, as
    ``loca fit`` does) and resumed from that file on every rank."""

    from loca.infra import distributed
    from loca.method.fit import fit
    from loca.method.state import load_fit_state, save_fit_state

    parts, _, maps, train, heldout, cfg = _dp_setup(rank, world, store)
    whole = fit(parts, maps, train, heldout, cfg, progress=False)
    whole_b = whole.adapters.get_b()
    whole.adapters.detach()

    def save_then_stop(state):
        if distributed.is_main():
            save_fit_state(state, f"{folder}/state")
        if state.iteration == 2:
            raise _Stop

    try:
        fit(parts, maps, train, heldout, cfg, on_checkpoint=save_then_stop, progress=False)
    except _Stop:
        pass
    distributed.barrier()
    state = load_fit_state(f"{folder}/state", parts)
    resumed = fit(parts, maps, train, heldout, cfg, resume=state, progress=False)
    out = {
        "whole": (whole_b, whole.best_iteration, whole.heldout_ce, whole.history),
        "resumed": (resumed.adapters.get_b(), resumed.best_iteration, resumed.heldout_ce, resumed.history),
        "from": state.iteration,
    }
    resumed.adapters.detach()
    if rank == 0:
        torch.save(out, f"{folder}/result.pt")
    _leave()


def test_a_data_parallel_fit_resumes_to_the_same_result(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_resume_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    out = torch.load(tmp_path / "result.pt")
    assert out["from"] == 2
    (wb, wit, wce, wh), (rb, rit, rce, rh) = out["whole"], out["resumed"]
    assert (rit, rce) == (wit, wce) and wit > 0
    strip = lambda h: [{k: v for k, v in r.items() if k not in ("time_s", "elapsed_s")} for r in h]  # noqa: E731
    assert strip(rh) == strip(wh)
    assert all(torch.equal(a, b) for a, b in zip(rb, wb, strict=True))


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _launch(argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``argv``; on a timeout (a hang) it and every process below it, torchrun's workers
    included, are killed and the test fails instead of waiting forever."""
    proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        pytest.fail(f"{' '.join(argv[:6])} ...: still running after {timeout} s (a deadlock)")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_fewer_batches_than_ranks_never_deadlock(root, tmp_path):
    """One batch per pass for two ranks (calibration, principal A, Stage II, held-out CE and the
    test evaluation): rank 1 holds none, takes part in every collective with zero sums, and the
    run ends with the numbers of one process. Its config.json says how it was run."""
    sizes = ["--n-train", "8", "--n-heldout", "4", "--n-test", "8", "--batch-size", "16"]
    sizes += [
        "--probe-micro-batch",
        "8",
        "--probe-positions",
        "40",
        "--max-iters",
        "2",
        "--a-init",
        "principal",
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    results = {}
    for name, argv in (("one", [sys.executable]), ("two", launch)):
        out = tmp_path / name
        argv = [*argv, "-m", "loca", "fit", *tiny_cli_args(root), *sizes, "--quiet", "--out", str(out)]
        proc = _launch(argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = json.loads((out / "results.json").read_text())
        results[name + "-config"] = json.loads((out / "config.json").read_text())["distributed"]
    for part in ("frozen", "loca"):
        for key, value in results["one"][part].items():
            assert results["two"][part][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (part, key)
    assert results["one-config"] == {"world_size": 1, "backend": None, "devices": ["cpu"], "hosts": 1}
    assert results["two-config"] == {
        "world_size": 2,
        "backend": "gloo",
        "devices": ["cpu", "cpu"],
        "hosts": 1,
    }


def _different_data_worker(rank: int, world: int, store: str, root: str) -> None:
    """One rank on its own copy of the task (rank 1's labels flipped, the same ids): a fit and an
    evaluation, each refused at its start; every rank records the error it got."""
    import torch.distributed as dist

    from loca import DataConfig, LocaConfig, ModelConfig, Pipeline
    from loca.eval.evaluation import evaluate

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    pipe = Pipeline(
        ModelConfig(model=f"{root}/model", device="cpu"),
        DataConfig(
            task=f"{root}/task{rank}.jsonl", template=SENTIMENT_TEMPLATE, n_train=8, n_heldout=4, n_test=4
        ),
        LocaConfig(rank=4, feedback_rank=4, max_iters=1, probe_positions=40),
        progress=False,
    )
    errors = {}
    for name, call in (
        ("fit", lambda: pipe.fit()),
        (
            "evaluate",
            lambda: evaluate(
                pipe.parts,
                pipe.tokenizer,
                pipe.task,
                pipe.splits.test,
                max_length=64,
                batch_size=16,
                add_eos=True,
            ),
        ),
    ):
        try:
            call()
        except ValueError as exc:
            errors[name] = str(exc)
    Path(root, f"errors{rank}.json").write_text(json.dumps(errors))
    _leave()


def test_ranks_that_read_different_data_are_refused_at_the_start(tmp_path):
    import torch.multiprocessing as mp

    save_model_and_task(tmp_path, 40)
    rows = [json.loads(line) for line in (tmp_path / "task.jsonl").read_text().splitlines()]
    (tmp_path / "task0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flipped = [{**r, "label": 1 - r["label"]} for r in rows]  # same ids, other labels
    (tmp_path / "task1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in flipped))
    mp.spawn(_different_data_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):  # both ranks stop with the same error (none waits for the other)
        errors = json.loads((tmp_path / f"errors{rank}.json").read_text())
        assert set(errors) == {"fit", "evaluate"}
        assert errors["fit"].startswith("the ranks see different training, held-out or test data: rank(s) 1")
        assert errors["evaluate"].startswith("the ranks see different evaluation examples: rank(s) 1")
        assert "same data files" in errors["fit"]
