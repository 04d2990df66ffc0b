"""Calibrate here, adapt there, use anywhere — each step in its own process, as on separate machines:

1. ``loca calibrate`` saves the maps;
2. ``loca fit --maps`` runs in a process where autograd is globally off, a saved-tensor hook
   fails on any autograd graph and ``backward`` cannot run; no parameter ever gets a ``.grad``;
3. a third process loads the adapter onto a plain ``AutoModelForCausalLM`` with
   ``loca.from_pretrained`` and gets the fit's test metrics exactly, and the same text with and
   without the KV cache;
and the fit from saved maps equals the fit that calibrates in one process; an interrupted fit,
resumed, equals an uninterrupted one; maps for another task or overlapping the fit's held-out
examples are refused."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file
from tiny import SENTIMENT_TEMPLATE, save_model_and_task, write_sentiment_task

pytestmark = pytest.mark.integration

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
DATA = ["--n-train", "16", "--n-heldout", "8", "--n-test", "10"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_model_and_task(tmp_path_factory.mktemp("two-machines"), 60)


def common(root) -> list[str]:
    return [
        "--model",
        str(root / "model"),
        "--task",
        str(root / "task.jsonl"),
        "--template",
        SENTIMENT_TEMPLATE,
        "--device",
        "cpu",
        "--feedback-rank",
        "4",
    ]


def stage2(root) -> list[str]:
    return [*common(root)[:-2], "--rank", "4", "--max-iters", "4", "--quiet"]


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a separate "machine")."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def loca(*argv: str) -> subprocess.CompletedProcess:
    return python("import sys; from loca.cli.main import main; sys.exit(main(sys.argv[1:]))", *argv)


FORWARD_ONLY = """
import sys, torch
torch.set_grad_enabled(False)  # the host has no use for autograd

def no_graph(t):
    raise AssertionError("an autograd graph was built")

def no_backward(*a, **k):
    raise AssertionError("backward was called")

torch.Tensor.backward = no_backward
import loca.pipeline
seen = []
real_run = loca.pipeline.Pipeline.run

def run(self, *args, **kwargs):  # keep the model's parameters to look at afterwards
    seen.extend(self.model.parameters())
    return real_run(self, *args, **kwargs)

loca.pipeline.Pipeline.run = run
with torch.autograd.graph.saved_tensors_hooks(no_graph, no_graph):
    from loca.cli.main import main
    code = main(sys.argv[1:])
assert not torch.is_grad_enabled()
assert seen and all(p.grad is None and not p.requires_grad for p in seen), "a parameter has a .grad"
sys.exit(code)
"""

THIRD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import loca
from loca.data import get_task, load_test
from loca.eval.evaluation import evaluate

model_dir, adapter, task_file, template, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(model_dir)  # a plain Hugging Face model
tok = AutoTokenizer.from_pretrained(model_dir)
adapters = loca.from_pretrained(model, adapter)
task = get_task(task_file, template=template)
examples, _ = load_test(task, n_test=10, seed=0)
parts = loca.find_parts(model)
metrics = evaluate(parts, tok, task, examples, max_length=256, batch_size=16, add_eos=True)
ids = tok("Review: a charming journey", return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
    gen = {str(c): model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=c,
                                  pad_token_id=tok.pad_token_id).tolist() for c in (True, False)}
    frozen = adapters.unload()(ids).logits
json.dump({"metrics": metrics, "gen": gen, "logits_changed": bool((logits - frozen).abs().max() > 0)},
          open(out, "w"))
"""


def b_of(folder) -> dict:
    return load_file(str(folder / "adapter" / "loca_adapter.safetensors"))


def same_adapters(a, b) -> bool:
    ta, tb = b_of(a), b_of(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_calibrate_here_fit_forward_only_there_use_anywhere(root):
    loca("calibrate", *common(root), *DATA, "--out", str(root / "maps"))
    maps_meta = json.loads((root / "maps" / "feedback_config.json").read_text())
    assert maps_meta["task"] == "task" and maps_meta["splits"]["seed"] == 0

    there = root / "fit-there"
    python(FORWARD_ONLY, "fit", *stage2(root), *DATA, "--maps", str(root / "maps"), "--out", str(there))
    results = json.loads((there / "results.json").read_text())
    assert results["improved"] and results["loca"]["test_ce"] < results["frozen"]["test_ce"]

    here = root / "fit-here"  # one process: calibration and fit together
    loca("fit", *stage2(root), "--feedback-rank", "4", *DATA, "--out", str(here))
    assert same_adapters(here, there)
    assert json.loads((here / "results.json").read_text())["loca"] == results["loca"]

    card = (there / "adapter" / "README.md").read_text()
    config = json.loads((there / "adapter" / "loca_adapter.json").read_text())
    assert config["feedback_rank"] == 4 and config["metrics"]["loca"] == results["loca"]
    assert config["selection"]["iteration"] == results["best_iteration"] and "loca.from_pretrained" in card

    out = root / "third.json"
    python(
        THIRD,
        str(root / "model"),
        str(there / "adapter"),
        str(root / "task.jsonl"),
        SENTIMENT_TEMPLATE,
        str(out),
    )
    third = json.loads(out.read_text())
    for key in ("test_ce", "test_ce_no_eos"):
        assert third["metrics"][key] == results["loca"][key]
    assert third["metrics"]["acc"] == results["loca"]["test_acc"]
    assert third["gen"]["True"] == third["gen"]["False"] and third["logits_changed"]


def test_maps_for_another_task_or_overlapping_heldout_are_refused(root, capsys):
    if not (root / "maps").exists():
        loca("calibrate", *common(root), *DATA, "--out", str(root / "maps"))
    from loca.cli.main import main

    other_task = root / "other.jsonl"
    write_sentiment_task(other_task, 60, random.Random(1))
    args = [*stage2(root), "--maps", str(root / "maps"), "--n-train", "16", "--n-test", "10"]
    with_task = [*args[: args.index("--task") + 1], str(other_task), *args[args.index("--task") + 2 :]]
    assert main(["fit", *with_task, "--n-heldout", "8"]) == 2
    assert "calibrated on task 'task', not 'other'" in capsys.readouterr().err
    assert main(["fit", *args, "--n-heldout", "8", "--seed", "1"]) == 2  # another draw: overlap
    err = capsys.readouterr().err
    assert "were calibrated on" in err and "of this run's held-out examples" in err


def test_an_interrupted_fit_resumes_to_the_same_result(root, tmp_path):
    args = [
        *stage2(root)[:-3],
        "--max-iters",
        "8",
        "--patience",
        "8",
        "--step-control",
        "fixed",
        "--etas",
        "0.001",
        "0.003",
        *DATA,
    ]
    whole = tmp_path / "whole"
    loca("fit", *args, "--quiet", "--out", str(whole))

    cut = tmp_path / "cut"
    argv = [sys.executable, "-m", "loca", "fit", *args, "--quiet", "--out", str(cut)]
    proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # stop it after its third iteration's checkpoint
            state = cut / "checkpoint" / "fit_state.json"
            if state.exists() and json.loads(state.read_text() or "{}").get("iteration", 0) >= 3:
                break
            assert proc.poll() is None, "the fit ended before it could be interrupted"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and not (cut / "results.json").exists()
    loca("fit", "--resume", "--out", str(cut), "--quiet")
    assert same_adapters(whole, cut)
    a, b = (json.loads((d / "results.json").read_text()) for d in (whole, cut))
    for key in ("frozen", "loca", "eta", "lam_rel", "best_iteration", "stop_reasons"):
        assert a[key] == b[key]

    def strip(d):
        rows = (json.loads(x) for x in (d / "history.jsonl").read_text().splitlines())
        return [{k: v for k, v in r.items() if k not in ("time_s", "elapsed_s")} for r in rows]

    assert strip(whole) == strip(cut)
    assert not (cut / "checkpoint").exists()  # removed once the run finished
    from loca.cli.main import main

    assert main(["fit", "--resume", "--out", str(cut)]) == 2  # finished: nothing to resume
    assert main(["fit", "--resume", "--out", str(cut), "--rank", "8"]) == 2  # settings come from the run
