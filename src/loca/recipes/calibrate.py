"""Stage I only: calibrate the feedback maps and save them for a forward-only host.

Example::

    loca calibrate --model smollm2-135m-instruct --task sst2 --out runs/maps
    loca fit --model smollm2-135m-instruct --task sst2 --maps runs/maps --out runs/fit

The maps carry the checkpoint's fingerprint; ``loca fit --maps`` refuses them for another model.
"""

from __future__ import annotations

import argparse

from ..calibrate import calibrate, select_probe
from ..data import encode_examples, get_task, load_splits
from ..data.batching import pad_token_id
from .common import (
    add_config_args,
    add_data_args,
    add_model_args,
    config_from_args,
    resolve_data_dir,
    setup_model,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_data_args(p, n_train=512, n_heldout=64, n_test=0)
    add_config_args(p)
    p.add_argument("--out", required=True, help="folder for feedback_maps.safetensors + feedback_config.json")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    task = get_task(args.task, template=args.template)
    splits = load_splits(
        task,
        n_train=args.n_train,
        n_heldout=args.n_heldout,
        n_test=args.n_test,
        seed=cfg.seed,
        data_dir=resolve_data_dir(args.data_dir),
    )
    _, tokenizer, parts = setup_model(args)
    enc = dict(max_length=cfg.max_length, add_eos=cfg.add_eos)
    probe = select_probe(encode_examples(tokenizer, task, splits.train, **enc), cfg.probe_positions, cfg.seed)
    heldout = select_probe(
        encode_examples(tokenizer, task, splits.heldout, **enc),
        max(1, cfg.probe_positions // 4),
        cfg.seed + 1,
    )
    maps = calibrate(
        parts,
        probe,
        heldout,
        rank=cfg.feedback_rank,
        beta_rel=cfg.beta_rel,
        micro_batch=cfg.probe_micro_batch,
        pad_id=pad_token_id(tokenizer),
        seed=cfg.seed,
    )
    maps.meta.update({"task": task.name, "splits": splits.record})
    maps.save_pretrained(args.out)
    a = maps.meta["alignment"]
    for i, (p, h, r) in enumerate(zip(a["probe"], a["heldout"], a["random"], strict=True)):
        print(f"block {i:3d}: alignment probe {p:+.3f}  held-out {h:+.3f}  random {r:+.3f}")
    print(f"saved {maps.meta['probe_positions']} probe positions' maps to {args.out}")
    return 0
