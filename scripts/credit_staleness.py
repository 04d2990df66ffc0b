"""Why do the feedback maps go stale, and can Stage I see it coming?

The block gradient at a position is linear in the head error, ``g_l = J_l(h)ᵀ e``, with a Jacobian
that depends on the position's state. A map fitted on the frozen model's errors learns that linear
relation only along the directions those errors take (the answer *format*); once the format is
learned, the errors point elsewhere and the map's alignment collapses. This script separates the
two causes, on one task:

1. probe at B = 0: the natural head errors and, through the *same* forward, ``--synthetic`` extra
   backward passes of synthetic errors ``W_u[j] − W_u[y]`` (j drawn from the probe's target tokens:
   "the model put its mass on another answer token"), each giving that error's exact gradients;
2. a short forward-only fit from the natural maps (the default LocaConfig, ``--fit-iters`` steps);
3. held-out probes at B = 0 and at the fitted adapters, and a training probe at the fitted adapters
   (the refit's upper bound);

then scores maps fitted on (a) the natural errors, (b) natural + synthetic errors, (c) the
synthetic errors alone, (d) the fitted state's errors (a refit: a probe backward during Stage II)
and (e) the B = 0 probe pooled with the fitted state's (what two calibration rounds do) on both
held-out probes: the median over blocks of the per-position alignment and of the alignment of
the adapter update ``Σ ĝ pᵀ``.

    .venv/bin/python scripts/credit_staleness.py --data-dir data --task arc_easy \
        --out docs/results/credit/staleness_arc_easy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from credit_study import cos  # scripts/ is on the path when this file runs

from loca.config import LocaConfig
from loca.core.head import head_loss_and_error
from loca.core.ridge import feedback_factors
from loca.data import encode_examples, get_task, load_splits
from loca.data.batching import make_batches, pad_token_id
from loca.method.adapters import adapter_a
from loca.method.calibrate import _pooled, calibrate
from loca.method.fit import fit
from loca.method.probe import select_probe
from loca.models.parts import at_positions, find_parts, load_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--task", default="arc_easy")
    p.add_argument("--n-train", type=int, default=300)
    p.add_argument("--n-heldout", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-positions", type=int, default=1000)
    p.add_argument("--heldout-positions", type=int, default=400)
    p.add_argument("--synthetic", type=int, default=4, help="synthetic error sets per probe position")
    p.add_argument("--fit-iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def probe(parts, items, pad, synthetic: int = 0, vocab: torch.Tensor | None = None, seed: int = 0):
    """Per set of errors (natural first, then the synthetic ones): e (N×d) and g_l (L×N×d); block
    inputs (L×N×d) at the predict positions."""
    sets: list[tuple[list, list]] = [([], []) for _ in range(1 + synthetic)]
    inputs: list[torch.Tensor] = []
    gen = torch.Generator().manual_seed(seed)
    w = parts.head.weight.detach().float()
    for batch in make_batches(items, pad, batch_size=8):
        outs, ins = [], []

        def hook(module, args, kwargs, output, outs=outs, ins=ins):
            ins.append(args[0] if args else kwargs["hidden_states"])
            outs.append(output[0] if isinstance(output, tuple) else output)

        handles = [blk.register_forward_hook(hook, with_kwargs=True) for blk in parts.blocks]
        try:
            with torch.enable_grad():
                embeds = parts.model.get_input_embeddings()(batch.input_ids).detach().requires_grad_(True)
                hn = parts.final_hidden(
                    batch.input_ids, batch.attention_mask, batch.pos_b, batch.pos_t, inputs_embeds=embeds
                )
                _, e = head_loss_and_error(
                    hn.detach(), parts.head.weight, parts.head.bias, batch.targets, parts.transform
                )
                errors = [e.float()]
                for _ in range(synthetic):
                    j = vocab[torch.randint(len(vocab), (len(batch.targets),), generator=gen)]
                    errors.append(w[j] - w[batch.targets])
                for k, err in enumerate(errors):
                    last = k == synthetic
                    grads = torch.autograd.grad(hn, outs, err.to(hn.dtype), retain_graph=not last)
                    rows = [at_positions(g, batch.pos_b, batch.pos_t).float() for g in grads]
                    sets[k][0].append(err)
                    sets[k][1].append(torch.stack(rows))
        finally:
            for h in handles:
                h.remove()
        inputs.append(torch.stack([at_positions(h, batch.pos_b, batch.pos_t).detach().float() for h in ins]))
    out = [(torch.cat(es), torch.cat(gs, 1)) for es, gs in sets]
    return out, torch.cat(inputs, 1)


def scores(predict, e, g, h, seed):
    """Median over blocks of the per-position and the update alignment of ``predict(l, e, h)``."""
    d = e.shape[1]
    per_pos, update = [], []
    for l in range(len(g)):
        pred = predict(l, e, h).double()
        per_pos.append(cos(pred, g[l]))
        p = h[l].double() @ adapter_a(seed, l, 32, d).double().T
        update.append(cos(pred.T @ p, g[l].double().T @ p))
    return {
        "alignment": statistics.median(per_pos),
        "update": statistics.median(update),
        "per_block": per_pos,
    }


def linear(factors):
    return lambda l, e, h: factors[l].apply(e)


def state_kernel(e0, g0, h0, power: int = 4, beta_rel: float = 1.0):
    """The product-kernel ridge ``(e·e')(ĥ·ĥ')^power`` (ĥ the block's normalised input) fitted on a
    probe: a map conditioned on the position's state (``scripts/credit_study.py``'s ``h^4``)."""
    unit = lambda x: x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)  # noqa: E731
    e0 = e0.double()
    kee, alphas = e0 @ e0.T, {}

    def predict(l, e, h):
        hp = unit(h0[l].double())
        if l not in alphas:
            k = kee * (hp @ hp.T).pow(power)
            beta = beta_rel * float(k.diagonal().mean())
            factor = torch.linalg.cholesky(k + beta * torch.eye(len(k), dtype=k.dtype))
            alphas[l] = torch.cholesky_solve(g0[l].double(), factor)
        return ((e.double() @ e0.T) * (unit(h[l].double()) @ hp.T).pow(power)) @ alphas[l]

    return predict


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    parts = find_parts(model)
    model.eval()
    task = get_task(args.task)
    splits = load_splits(
        task, n_train=args.n_train, n_heldout=args.n_heldout, n_test=1, seed=args.seed, data_dir=args.data_dir
    )
    enc = dict(max_length=256, add_eos=True)
    train = encode_examples(tok, task, splits.train, **enc)
    held = encode_examples(tok, task, splits.heldout, **enc)
    pad = pad_token_id(tok)
    pr = select_probe(train, args.probe_positions, args.seed)
    hpr = select_probe(held, args.heldout_positions, args.seed + 1)
    vocab = torch.tensor(sorted({t for it in pr for t in it.completion}))
    sets0, hp0 = probe(parts, pr, pad, args.synthetic, vocab, args.seed)
    [(he0, hg0)], hh0 = probe(parts, hpr, pad)
    print(f"B = 0 probes in {time.perf_counter() - t0:.0f}s", flush=True)

    cfg = LocaConfig(max_iters=args.fit_iters, cuda_graphs=False)
    maps = calibrate(parts, pr, feedback_rank=cfg.feedback_rank, beta_rel=cfg.beta_rel, pad_id=pad)
    batches = [make_batches(x, pad, cfg.batch_size) for x in (train, held)]
    with torch.no_grad():
        res = fit(parts, maps, *batches, cfg, progress=False)
    print(
        f"fit: held-out CE {res.frozen_heldout_ce:.3f} -> {res.heldout_ce:.3f} (iteration "
        f"{res.best_iteration})",
        flush=True,
    )
    [(he1, hg1)], hh1 = probe(parts, hpr, pad)
    pe1, pg1 = probe(parts, pr, pad)[0][0]
    res.adapters.detach()

    k, beta = cfg.feedback_rank, cfg.beta_rel
    e0, g0 = sets0[0]
    maps_by = {"natural (B = 0)": linear(feedback_factors(e0, list(g0), beta, k))}
    pool = [(e, list(g), torch.zeros(len(e))) for e, g in sets0]
    pe, pg, _ = _pooled(pool)
    maps_by[f"natural + {args.synthetic} synthetic (B = 0)"] = linear(feedback_factors(pe, pg, beta, k))
    pe, pg, _ = _pooled(pool[1:])
    maps_by["synthetic only (B = 0)"] = linear(feedback_factors(pe, pg, beta, k))
    maps_by["refit at the fitted state"] = linear(feedback_factors(pe1, list(pg1), beta, k))
    # what calibration rounds do: the B = 0 probe pooled with one taken at the fitted state
    pe, pg, _ = _pooled([pool[0], (pe1, list(pg1), torch.zeros(len(pe1)))])
    maps_by["B = 0 pooled with the fitted state (2 rounds)"] = linear(feedback_factors(pe, pg, beta, k))
    maps_by["state kernel h^4 at B = 0 (credit_study.py)"] = state_kernel(e0, g0, hp0)
    report = {
        "config": vars(args),
        "fit": {
            "frozen": res.frozen_heldout_ce,
            "heldout_ce": res.heldout_ce,
            "best_iteration": res.best_iteration,
        },
        "maps": {},
    }
    for name, predict in maps_by.items():
        at0 = scores(predict, he0, hg0, hh0, args.seed)
        at1 = scores(predict, he1, hg1, hh1, args.seed)
        report["maps"][name] = {"heldout_B0": at0, "heldout_fitted": at1}
        print(
            f"{name:<36} B=0: align {at0['alignment']:+.3f} update {at0['update']:+.3f} | fitted: align "
            f"{at1['alignment']:+.3f} update {at1['update']:+.3f}",
            flush=True,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
