"""Check loca's ``acc``/``acc_norm`` (and their standard errors) against lm-evaluation-harness.

For each task, a seeded sample of test items (``loca.data.load_test``) is scored three ways on the
same model object:

* **loca**: :func:`loca.eval.evaluation.evaluate` (the reported numbers) and
  :func:`loca.eval.evaluation.score_choices` over :func:`loca.data.encoding.encode_choices` (per choice);
* **lm-eval, by hand**: ``HFLM.loglikelihood`` on ``Instance(request_type="loglikelihood",
  arguments=(prompt, " " + choice))`` requests, then ``acc``/``acc_norm`` as
  ``ConfigurableTask.process_results`` computes them for ``multiple_choice`` (``np.argmax(lls)``
  and ``np.argmax(lls / len(choice))``, the length of the choice text *without* the target
  delimiter) and ``lm_eval.api.metrics.mean``/``mean_stderr``;
* **lm-eval, end to end**: a ``ConfigurableTask`` (``output_type: multiple_choice``,
  ``target_delimiter: " "``) over the same rendered prompts and choices, run through
  ``lm_eval.evaluator.evaluate`` (its own requests, ``process_results`` and aggregation).

It also compares the token ids: loca's separately tokenised prompt and completion against
``HFLM._encode_pair`` (context and context + continuation, split).

Install (in a separate venv, so the project's torch/transformers pins stay untouched)::

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 \
        && /tmp/lmeval/bin/pip install lm-eval -e .

Run from the project root::

    /tmp/lmeval/bin/python scripts/check_lm_eval.py --data-dir data \
        --out docs/results/lm_eval_check.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

TOL_LOGLIK = 1e-3  # |Δ loglik| that counts as the same number (float32 forward passes, other padding)
TOL_STDERR = 1e-12  # same stderr up to summation order (math.fsum vs sum)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="loca alias, folder or hub id")
    p.add_argument("--data-dir", required=True, help="the task data folder (docs/tasks.md)")
    p.add_argument("--tasks", nargs="+", default=["sst2", "arc_easy", "hellaswag", "boolq", "obqa"])
    p.add_argument("--n", type=int, default=40, help="test items per task (seeded sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-length",
        type=int,
        default=4096,
        help="loca's max_length; large enough that no prompt is truncated (lm-eval does "
        "not truncate below the model's context, 8192 for SmolLM2)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="for loca and for HFLM")
    p.add_argument(
        "--float64",
        action="store_true",
        help="run the model in float64 (shows the float32 Δ loglik is rounding alone)",
    )
    p.add_argument(
        "--no-harness", action="store_true", help="skip the end-to-end lm_eval.evaluator.evaluate run"
    )
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def choice_texts(ex) -> list[str]:
    """The choice texts as loca renders them (``task.completion`` is ``" " + text``)."""
    return [c.strip() for c in ex.choices]


# --- loca ------------------------------------------------------------------------------------


def loca_side(parts, tokenizer, task, examples, max_length: int, batch_size: int) -> dict:
    from loca.data.batching import make_batches, pad_token_id
    from loca.data.encoding import encode_choices
    from loca.eval.evaluation import evaluate, score_choices
    from loca.eval.metrics import rank_choices

    metrics = evaluate(
        parts, tokenizer, task, examples, max_length=max_length, batch_size=batch_size, add_eos=task.add_eos
    )
    # the sequences evaluate() ranks: the gold one carries EOS (left out of its score), which also
    # fixes how much prompt every choice keeps when a prompt must be truncated
    labels = [ex.label for ex in examples]
    items = encode_choices(tokenizer, task, examples, max_length, eos_on_gold=task.add_eos)
    scores, _ = score_choices(parts, make_batches(items, pad_token_id(tokenizer), batch_size), labels)
    ranking = rank_choices(scores, len(examples), labels)
    lls = [[scores[(i, c)][0] for c in range(len(ex.choices))] for i, ex in enumerate(examples)]
    ids = {
        (it.source, it.choice): (list(it.prompt), list(it.completion[: len(it.completion) - it.has_eos]))
        for it in items
    }
    return {"metrics": metrics, "ranking": ranking, "lls": lls, "ids": ids}


# --- lm-eval ---------------------------------------------------------------------------------


def lm_eval_by_hand(lm, task, examples) -> dict:
    """``HFLM.loglikelihood`` on hand-made requests, then ``process_results``' arithmetic."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.metrics import mean, mean_stderr

    requests, where = [], []
    for i, ex in enumerate(examples):
        ctx = task.prompt(ex)
        doc = {"id": ex.id, "prompt": ctx, "choices": choice_texts(ex), "label": ex.label}
        for c, text in enumerate(choice_texts(ex)):
            requests.append(
                Instance(
                    request_type="loglikelihood",
                    doc=doc,
                    arguments=(ctx, " " + text),
                    idx=c,
                    metadata=(task.name, i, 1),
                )
            )
            where.append((i, c))
    results = lm.loglikelihood(requests, disable_tqdm=True)
    lls: list[list[float]] = [[math.nan] * len(ex.choices) for ex in examples]
    for (i, c), (ll, _greedy) in zip(where, results, strict=True):
        lls[i][c] = float(ll)
    acc, acc_norm = [], []
    for ex, row in zip(examples, lls, strict=True):
        # ConfigurableTask.process_results, output_type multiple_choice, one gold index:
        row = np.array(row)
        completion_len = np.array([float(len(t)) for t in choice_texts(ex)])  # delimiter not counted
        acc.append(1.0 if np.argmax(row) == ex.label else 0.0)
        acc_norm.append(1.0 if np.argmax(row / completion_len) == ex.label else 0.0)
    ids = {}
    for i, ex in enumerate(examples):
        for c, text in enumerate(choice_texts(ex)):
            ctx_enc, cont_enc = lm._encode_pair(task.prompt(ex), " " + text)
            ids[(i, c)] = (list(ctx_enc), list(cont_enc))
    return {
        "lls": lls,
        "correct": acc,
        "correct_norm": acc_norm,
        "acc": mean(acc),
        "acc_norm": mean(acc_norm),
        "acc_stderr": mean_stderr(acc),
        "acc_norm_stderr": mean_stderr(acc_norm),
        "ids": ids,
    }


def lm_eval_end_to_end(lm, task, examples) -> dict:
    """The same items as a harness ``ConfigurableTask`` run by ``lm_eval.evaluator.evaluate``."""
    import datasets
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.evaluator import evaluate as harness_evaluate

    docs = [
        {"id": ex.id, "prompt": task.prompt(ex), "choices": choice_texts(ex), "label": ex.label}
        for ex in examples
    ]
    name = f"loca_{task.name}"
    config = {
        "task": name,
        "custom_dataset": lambda **_: {"test": datasets.Dataset.from_list(docs)},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "prompt",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": " ",
        "metric_list": [
            {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")
        ],
    }
    out = harness_evaluate(
        lm=lm,
        task_dict={name: ConfigurableTask(config=config)},
        log_samples=True,
        bootstrap_iters=100000,
        verbosity="ERROR",
    )
    res = out["results"][name]
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    if [s["doc"]["id"] for s in samples] != [ex.id for ex in examples]:
        raise RuntimeError(f"{name}: the harness returned other documents than were given")
    return {
        "lls": [[float(r[0]) for r in s["filtered_resps"]] for s in samples],
        "correct": [s["acc"] for s in samples],
        "correct_norm": [s["acc_norm"] for s in samples],
        "acc": res["acc,none"],
        "acc_norm": res["acc_norm,none"],
        "acc_stderr": res["acc_stderr,none"],
        "acc_norm_stderr": res["acc_norm_stderr,none"],
    }


def token_check_all(lm, tokenizer, task, data_dir, max_length: int) -> dict:
    """Token ids of every (item, choice) of the whole test split: loca's against ``_encode_pair``."""
    from loca.data import load_test
    from loca.data.encoding import encode_choices

    examples, _ = load_test(task, n_test=None, data_dir=data_dir)
    items = encode_choices(tokenizer, task, examples, max_length, eos_on_gold=task.add_eos)  # as evaluate()
    differ = []
    for it in items:
        ex = examples[it.source]
        ctx, cont = lm._encode_pair(task.prompt(ex), task.completion(ex, it.choice))
        completion = list(it.completion[: len(it.completion) - it.has_eos])
        if (list(it.prompt), completion) != (list(ctx), list(cont)):
            differ.append((ex.id, it.choice))
    return {
        "n_items": len(examples),
        "n_sequences": len(items),
        "differ": len(differ),
        "first_differing": differ[:5],
    }


# --- comparison ------------------------------------------------------------------------------


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def summary(res: dict) -> dict:
    return {k: res[k] for k in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr")}


def same_numbers(a: dict, b: dict) -> bool:
    return (
        a["acc"] == b["acc"]
        and a["acc_norm"] == b["acc_norm"]
        and abs(a["acc_stderr"] - b["acc_stderr"]) <= TOL_STDERR
        and abs(a["acc_norm_stderr"] - b["acc_norm_stderr"]) <= TOL_STDERR
    )


def compare_task(parts, lm, tokenizer, task_name: str, args) -> dict:
    from loca.data import get_task, load_test

    task = get_task(task_name)
    examples, _record = load_test(task, n_test=args.n, seed=args.seed, data_dir=args.data_dir)
    t0 = time.time()
    loca = loca_side(parts, tokenizer, task, examples, args.max_length, args.batch_size)
    hand = lm_eval_by_hand(lm, task, examples)
    harness = None if args.no_harness else lm_eval_end_to_end(lm, task, examples)
    tokens_all = token_check_all(lm, tokenizer, task, args.data_dir, args.max_length)

    keys = sorted(loca["ids"])
    token_diff = [k for k in keys if loca["ids"][k] != hand["ids"][k]]
    first = keys[0]
    example_ids = {
        "item": examples[first[0]].id,
        "choice": first[1],
        "prompt": task.prompt(examples[first[0]])[-80:],
        "completion": task.completion(examples[first[0]], first[1]),
        "loca_prompt_tail": loca["ids"][first][0][-8:],
        "loca_completion": loca["ids"][first][1],
        "lm_eval_context_tail": hand["ids"][first][0][-8:],
        "lm_eval_continuation": hand["ids"][first][1],
        "loca_prompt_len": len(loca["ids"][first][0]),
        "lm_eval_context_len": len(hand["ids"][first][0]),
    }
    mismatch = None
    if token_diff:
        k = token_diff[0]
        mismatch = {
            "item": examples[k[0]].id,
            "choice": k[1],
            "loca": loca["ids"][k],
            "lm_eval": hand["ids"][k],
        }

    ranking = loca["ranking"]
    loca_numbers = summary(loca["metrics"])
    out = {
        "task": task_name,
        "n_items": len(examples),
        "n_choices": sum(len(ex.choices) for ex in examples),
        "n_truncated_by_loca": loca["metrics"]["n_truncated"],
        "token_ids_differ": len(token_diff),
        "token_check_whole_test_split": tokens_all,
        "token_example": example_ids,
        "token_mismatch": mismatch,
        "max_abs_dloglik": max_abs_diff(loca["lls"], hand["lls"]),
        "acc_pred_differs": [
            examples[i].id for i in range(len(examples)) if float(ranking["correct"][i]) != hand["correct"][i]
        ],
        "acc_norm_pred_differs": [
            examples[i].id
            for i in range(len(examples))
            if float(ranking["correct_norm"][i]) != hand["correct_norm"][i]
        ],
        "loca": loca_numbers,
        "loca_score_choices_matches_evaluate": same_numbers(loca_numbers, ranking),
        "lm_eval": summary(hand),
        "equal": same_numbers(loca_numbers, hand),
        "stderr_abs_diff": max(abs(loca_numbers[k] - hand[k]) for k in ("acc_stderr", "acc_norm_stderr")),
    }
    if harness is not None:
        out["lm_eval_harness"] = summary(harness)
        out["harness_max_abs_dloglik"] = max_abs_diff(loca["lls"], harness["lls"])
        out["harness_equal"] = same_numbers(loca_numbers, harness)
        out["harness_per_item_equal"] = (
            harness["correct"] == hand["correct"] and harness["correct_norm"] == hand["correct_norm"]
        )
    out["seconds"] = round(time.time() - t0, 1)
    return out


def print_row(r: dict) -> None:
    lo, le = r["loca"], r["lm_eval"]
    print(
        f"{r['task']:<10} n={r['n_items']:<4} choices={r['n_choices']:<4} "
        f"tok_diff={r['token_ids_differ']:<3} "
        f"max|Δll|={r['max_abs_dloglik']:.2e}  pred_diff acc/norm={len(r['acc_pred_differs'])}/"
        f"{len(r['acc_norm_pred_differs'])}"
    )
    t = r["token_check_whole_test_split"]
    print(f"    token ids over the whole test split: {t['differ']} of {t['n_sequences']} sequences differ")
    for name, m in (("loca", lo), ("lm-eval", le)) + (
        (("harness", r["lm_eval_harness"]),) if "lm_eval_harness" in r else ()
    ):
        print(
            f"    {name:<8} acc {m['acc']:.4f} ± {m['acc_stderr']:.6f}   "
            f"acc_norm {m['acc_norm']:.4f} ± {m['acc_norm_stderr']:.6f}"
        )
    print(f"    equal: {r['equal']}" + (f"  (harness: {r['harness_equal']})" if "harness_equal" in r else ""))
    ex = r["token_example"]
    print(
        f"    tokens of {ex['item']} choice {ex['choice']} ({ex['completion']!r}): "
        f"loca prompt[-8:] {ex['loca_prompt_tail']} + {ex['loca_completion']} | "
        f"lm-eval context[-8:] {ex['lm_eval_context_tail']} + {ex['lm_eval_continuation']}"
    )
    if r["token_mismatch"]:
        print(f"    first token mismatch: {r['token_mismatch']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    from loca.models.parts import find_parts, load_model

    logging.getLogger("lm-eval").setLevel(logging.ERROR)
    model, tokenizer = load_model(args.model, device="cpu")
    if args.float64:
        model.double()
    parts = find_parts(model)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size)
    rows = []
    for name in args.tasks:
        row = compare_task(parts, lm, tokenizer, name, args)
        print_row(row)
        rows.append(row)
    all_equal = all(r["equal"] and r.get("harness_equal", True) for r in rows)
    result = {
        "settings": {
            "model": args.model,
            "data_dir": args.data_dir,
            "tasks": args.tasks,
            "n": args.n,
            "seed": args.seed,
            "loca_max_length": args.max_length,
            "batch_size": args.batch_size,
            "device": "cpu",
            "dtype": str(next(model.parameters()).dtype),
            "lm_eval_max_length": lm.max_length,
            "lm_eval_add_bos_token": lm.add_bos_token,
            "tokenizer_bos": tokenizer.bos_token,
            "tol_stderr": TOL_STDERR,
            "tol_loglik": TOL_LOGLIK,
        },
        "versions": {
            "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "all_equal": all_equal,
        "max_abs_dloglik": max(r["max_abs_dloglik"] for r in rows),
        "tasks": rows,
    }
    print(f"all equal: {all_equal}; max |Δ loglik| over all choices {result['max_abs_dloglik']:.2e}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if all_equal and result["max_abs_dloglik"] <= TOL_LOGLIK else 1


if __name__ == "__main__":
    sys.exit(main())
