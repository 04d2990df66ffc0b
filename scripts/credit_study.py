"""Offline study of credit mechanisms: how well does each map from head errors (and what else a
forward pass knows at a predict position) predict the true block-output gradients on held-out data?

Step 1 (``collect``): one probe backward over a seeded probe of the training items and one over the
held-out items (as :class:`loca.method.calibrate.Calibrator` draws them), keeping per predict position the
head error e, every block's true gradient g_l, every block's *input* h_{l-1}, the position's role
(first answer token, inside, EOS) and its target token. Cached in ``--cache``.

Step 2 (``evaluate``): fit each credit variant on the probe rows and score its held-out alignment
(Frobenius cosine of predicted vs true gradients, median over blocks) and the alignment of the
adapter update it implies (``Σ_t ĝ_t p_tᵀ`` vs ``Σ_t g_t p_tᵀ`` with the adapter codes p = A h).

    .venv/bin/python scripts/credit_study.py --data-dir data --task arc_easy \
        --cache runs/credit/arc_easy.pt --out docs/results/credit_study/arc_easy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from loca.data import encode_examples, get_task, load_splits
from loca.data.batching import make_batches, pad_token_id
from loca.method.adapters import adapter_a
from loca.method.probe import _probe_step, select_probe
from loca.models.parts import at_positions, find_parts, load_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--task", default="arc_easy")
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-heldout", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-positions", type=int, default=1000)
    p.add_argument("--heldout-positions", type=int, default=500)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=None, help="score only the variants whose name contains this")
    return p.parse_args(argv)


def collect(parts, items, pad, micro_batch):
    """Per predict position: e (N×d), g_l and h_{l-1} (L×N×d), role (N), target (N)."""
    rows_e, rows_g, rows_h, roles, targets = [], [], [], [], []
    where = {}
    captured_in: dict[int, torch.Tensor] = {}

    def hook(layer):
        def f(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            captured_in[layer] = at_positions(h, where["b"], where["t"]).detach().float()

        return f

    handles = [b.register_forward_pre_hook(hook(l), with_kwargs=True) for l, b in enumerate(parts.blocks)]
    try:
        for batch in make_batches(items, pad, batch_size=micro_batch):
            where["b"], where["t"] = batch.pos_b, batch.pos_t
            e, g = _probe_step(parts, batch, recompute=False)
            rows_e.append(e)
            rows_g.append(torch.stack([g[l] for l in range(parts.num_blocks)]))
            rows_h.append(torch.stack([captured_in[l] for l in range(parts.num_blocks)]))
            # role: 0 = first completion token (predicted at the prompt's end), 1 = inside, 2 = EOS
            first = torch.zeros_like(batch.is_eos)
            for row in range(len(batch.items)):
                idx = (batch.pos_b == row).nonzero().flatten()
                first[idx[0]] = True
            role = torch.where(batch.is_eos, 2, torch.where(first, 0, 1))
            roles.append(role)
            targets.append(batch.targets)
    finally:
        for h in handles:
            h.remove()
    return {
        "e": torch.cat(rows_e),
        "g": torch.cat(rows_g, 1),
        "h": torch.cat(rows_h, 1),
        "role": torch.cat(roles),
        "target": torch.cat(targets),
    }


def cos(a, b):
    a, b = a.double(), b.double()
    d = float(a.norm() * b.norm())
    return float((a * b).sum()) / d if d > 0 else 0.0


def kernel_ridge(k_train, k_cross, y, beta_rel):
    """Dual ridge prediction: Y_pred = K_x (K + βI)^{-1} Y with β relative to trace(K)/N."""
    n = k_train.shape[0]
    beta = beta_rel * float(k_train.diagonal().sum()) / n
    factor = torch.linalg.cholesky(k_train + beta * torch.eye(n, dtype=k_train.dtype))
    alpha = torch.cholesky_solve(y, factor)
    return k_cross @ alpha


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = Path(args.cache)
    if cache.is_file():
        data = torch.load(cache)
    else:
        model, tok = load_model(args.model)
        parts = find_parts(model)
        model.eval()
        task = get_task(args.task)
        splits = load_splits(
            task,
            n_train=args.n_train,
            n_heldout=args.n_heldout,
            n_test=1,
            seed=args.seed,
            data_dir=args.data_dir,
        )
        enc = dict(max_length=args.max_length, add_eos=True)
        train = encode_examples(tok, task, splits.train, **enc)
        held = encode_examples(tok, task, splits.heldout, **enc)
        pad = pad_token_id(tok)
        t0 = time.perf_counter()
        probe = select_probe(train, args.probe_positions, args.seed)
        hprobe = select_probe(held, args.heldout_positions, args.seed + 1)
        data = {
            "probe": collect(parts, probe, pad, args.micro_batch),
            "heldout": collect(parts, hprobe, pad, args.micro_batch),
        }
        print(
            f"collected in {time.perf_counter() - t0:.0f}s: {data['probe']['e'].shape[0]} / "
            f"{data['heldout']['e'].shape[0]} positions",
            flush=True,
        )
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, cache)
    report = evaluate(data, args.seed, args.only)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "variants": report}, indent=1))


def features(d: dict, l: int, kind: str, mean: torch.Tensor | None = None) -> torch.Tensor:
    """A state code c per position for the product kernel (e·e')(c·c')."""
    h = d["h"][l].double()
    if kind == "h":
        x = h
    elif kind == "hc":
        x = h - mean
    elif kind == "role":
        return torch.nn.functional.one_hot(d["role"], 3).double()
    else:
        raise ValueError(kind)
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)


def kmeans(x: torch.Tensor, m: int, seed: int, iters: int = 30) -> torch.Tensor:
    """Centroids (m×D) of spherical k-means on the rows of ``x`` (unit norm), seeded."""
    gen = torch.Generator().manual_seed(seed)
    c = x[torch.randperm(x.shape[0], generator=gen)[:m]].clone()
    for _ in range(iters):
        lab = (x @ c.T).argmax(1)
        for j in range(m):
            sel = x[lab == j]
            if len(sel):
                c[j] = sel.sum(0) / sel.sum(0).norm().clamp_min(1e-30)
    return c


def evaluate(data, seed, only=None):
    P, H = data["probe"], data["heldout"]
    L = P["g"].shape[0]
    d = P["e"].shape[1]
    ep, eh = P["e"].double(), H["e"].double()
    kee = ep @ ep.T
    kxe = eh @ ep.T
    a = [adapter_a(seed, l, 32, d).double() for l in range(L)]
    variants = {}

    def score(name, predict):
        """predict(l) -> (pred on probe, pred on held-out)."""
        if only and only not in name:
            return
        rows = {"probe": [], "heldout": [], "update": [], "step": []}
        for l in range(L):
            pp, ph = predict(l)
            gp, gh = P["g"][l].double(), H["g"][l].double()
            rows["probe"].append(cos(pp, gp))
            rows["heldout"].append(cos(ph, gh))
            codes = H["h"][l].double() @ a[l].T
            rows["update"].append(cos(ph.T @ codes, gh.T @ codes))
            gram = codes.T @ codes  # the step LoCA takes: Σ ĝ pᵀ (G + λI)⁻¹, λ = 1e-3·tr(G)/r
            pre = torch.linalg.inv(gram + 1e-3 * gram.trace() / 32 * torch.eye(32, dtype=gram.dtype))
            rows["step"].append(cos(ph.T @ codes @ pre, gh.T @ codes @ pre))
        variants[name] = {f"{k}_median": statistics.median(v) for k, v in rows.items()} | {
            f"{k}_per_block": v for k, v in rows.items()
        }
        r = variants[name]
        print(
            f"{name:<40} heldout {r['heldout_median']:+.3f}  update {r['update_median']:+.3f}  "
            f"step {r['step_median']:+.3f}  probe {r['probe_median']:+.3f}",
            flush=True,
        )

    for beta in (0.1, 1.0, 10.0):
        score(
            f"linear beta={beta}",
            lambda l, b=beta: (
                kernel_ridge(kee, kee, P["g"][l].double(), b),
                kernel_ridge(kee, kxe, P["g"][l].double(), b),
            ),
        )
    role_p = torch.nn.functional.one_hot(P["role"], 3).double()
    role_h = torch.nn.functional.one_hot(H["role"], 3).double()
    for gamma in (0.0, 1.0):
        kp = kee * (gamma + role_p @ role_p.T)
        kx = kxe * (gamma + role_h @ role_p.T)
        score(
            f"role-gated gamma={gamma}",
            lambda l, kp=kp, kx=kx: (
                kernel_ridge(kp, kp, P["g"][l].double(), 1.0),
                kernel_ridge(kp, kx, P["g"][l].double(), 1.0),
            ),
        )
    tp, th = P["target"], H["target"]
    ktok_p = (tp[:, None] == tp[None, :]).double()
    ktok_h = (th[:, None] == tp[None, :]).double()
    score(
        "target-token gamma=1",
        lambda l: (
            kernel_ridge(kee * (1 + ktok_p), kee * (1 + ktok_p), P["g"][l].double(), 1.0),
            kernel_ridge(kee * (1 + ktok_p), kxe * (1 + ktok_h), P["g"][l].double(), 1.0),
        ),
    )
    for kind in ("h", "hc"):
        for power in (1, 2, 4):

            def pred(l, kind=kind, power=power):
                mean = P["h"][l].double().mean(0)
                cp, ch = features(P, l, kind, mean), features(H, l, kind, mean)
                sp, sx = cp @ cp.T, ch @ cp.T
                kp, kx = kee * sp.pow(power), kxe * sx.pow(power)
                g = P["g"][l].double()
                return kernel_ridge(kp, kp, g, 1.0), kernel_ridge(kp, kx, g, 1.0)

            score(f"state kernel {kind}^{power}", pred)
    for power in (2, 4):

        def pred_rs(l, power=power):
            cp, ch = features(P, l, "h"), features(H, l, "h")
            kp = kee * (role_p @ role_p.T) * (cp @ cp.T).pow(power)
            kx = kxe * (role_h @ role_p.T) * (ch @ cp.T).pow(power)
            g = P["g"][l].double()
            return kernel_ridge(kp, kp, g, 1.0), kernel_ridge(kp, kx, g, 1.0)

        score(f"role x state kernel h^{power}", pred_rs)
    # a mixture of maps gated by spherical k-means of a block's input codes (A h, as Stage II has
    # them): the block's own input, or the top block's input for every block
    for src in ("own", "top"):
        for m in (2, 4, 8):
            for with_role in (False, True):

                def pred_cl(l, src=src, m=m, with_role=with_role):
                    b = l if src == "own" else L - 1
                    cp = P["h"][b].double() @ a[b].T
                    ch = H["h"][b].double() @ a[b].T
                    cp, ch = cp / cp.norm(dim=1, keepdim=True), ch / ch.norm(dim=1, keepdim=True)
                    cent = kmeans(cp, m, seed)
                    op = torch.nn.functional.one_hot((cp @ cent.T).argmax(1), m).double()
                    oh = torch.nn.functional.one_hot((ch @ cent.T).argmax(1), m).double()
                    gp, gx = op @ op.T, oh @ op.T
                    if with_role:
                        gp, gx = gp * (role_p @ role_p.T), gx * (role_h @ role_p.T)
                    kp, kx = kee * gp, kxe * gx
                    g = P["g"][l].double()
                    return kernel_ridge(kp, kp, g, 1.0), kernel_ridge(kp, kx, g, 1.0)

                score(f"cluster {src} m={m}{' x role' if with_role else ''}", pred_cl)
    # the top block's input as a shared state for every block
    for power in (1, 2):

        def pred_top(l, power=power):
            top = L - 1
            mean = P["h"][top].double().mean(0)
            cp, ch = features(P, top, "hc", mean), features(H, top, "hc", mean)
            kp, kx = kee * (cp @ cp.T).pow(power), kxe * (ch @ cp.T).pow(power)
            g = P["g"][l].double()
            return kernel_ridge(kp, kp, g, 1.0), kernel_ridge(kp, kx, g, 1.0)

        score(f"top-state kernel hc^{power}", pred_top)
    return variants


if __name__ == "__main__":
    main()
