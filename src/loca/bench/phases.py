"""The phases ``loca bench`` times side by side, on the same batches of one pipeline.

- ``forward-floor``: the best inference forward over the training batches, the floor every
  ``× floor`` ratio is taken against: the backbone, then the LM head only at the predict
  positions (logits nowhere else), graph-captured on one CUDA device (eager elsewhere).
- ``forward``: the causal LM's plain eager forward, logits at every position, as ``model(...)``
  runs it (an extra row, not the floor); ``backbone``: the same without the LM head.
- ``calibrate``: Stage I (probe forward + backward, ridge fits).
- ``stage2``: one Stage II step, :func:`loca.method.stage2.stage2_pass` with non-zero adapters (on one
  CUDA device through the CUDA graphs a fit uses, captured in the untimed warm-up);
  ``stage2-eager``: the same step without graphs (the two differ only on a GPU).
- ``full-run``: what ``loca fit`` does before evaluating: calibration, then a fit of
  ``full_run_iters`` iterations with its held-out selection.
- ``lora``: one epoch of PEFT LoRA (rank 32 on q/k/v/o, forward + backward + AdamW, one step per
  batch) on the same batches, with :mod:`loca.baselines.lora`.
- ``adapter-mezo`` / ``mezo``: as many SPSA steps (two forwards each) as LoRA takes optimizer
  steps, on LoCA's adapters / on every parameter.

The baselines include their (tiny) held-out evaluations, which ``loca bench`` keeps to one example.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..method.adapters import ResidualAdapters
from ..method.calibrate import Calibrator
from ..method.graphs import BatchGraphs, batch_graphs
from ..method.run import calibrate_maps, run_loca
from ..method.stage2 import block_groups, stage2_pass

PHASES = (
    "forward-floor",
    "forward",
    "backbone",
    "calibrate",
    "stage2",
    "stage2-eager",
    "full-run",
    "lora",
    "adapter-mezo",
    "mezo",
)
# passes over the training tokens each phase makes (for tokens/s); None: not a pass over them
PASSES = {
    "forward-floor": 1,
    "forward": 1,
    "backbone": 1,
    "stage2": 1,
    "stage2-eager": 1,
    "lora": 1,
    "adapter-mezo": 2,
    "mezo": 2,
}


def predict_logits(parts, batch) -> torch.Tensor:
    """The logits at the predict positions only (N × V): what the best inference forward forms."""
    hn = parts.final_hidden(batch.input_ids, batch.attention_mask, batch.pos_b, batch.pos_t)
    return parts.transform.apply(torch.nn.functional.linear(hn, parts.head.weight, parts.head.bias))[0]


def build_phases(pipeline, names: list[str], full_run_iters: int = 5) -> dict[str, Callable[[], object]]:
    """One callable per phase in ``names``, each leaving the model as it found it."""
    parts, model, cfg = pipeline.parts, pipeline.model, pipeline.cfg
    train_items = pipeline.encoded()[0]
    train, heldout = pipeline.batched()
    batches = [b.to(parts.device) for b in train]

    def calibrate():  # Stage I on the training items (no held-out alignment diagnostic)
        return calibrate_maps(Calibrator(parts, train_items, [], cfg, pipeline.pad_id), batches, heldout, cfg)

    phases: dict[str, Callable[[], object]] = {}

    @torch.inference_mode()
    def forward():
        for b in batches:
            model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)

    @torch.inference_mode()
    def backbone():
        for b in batches:
            parts.backbone(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)

    def floor_logits(b) -> tuple:
        return (predict_logits(parts, b),)

    floor_graphs = None
    if "forward-floor" in names and cfg.cuda_graphs:  # captured in the untimed warm-up
        floor_graphs = batch_graphs(parts, ResidualAdapters(parts, rank=cfg.rank, seed=cfg.seed), batches)

    @torch.inference_mode()
    def forward_floor():
        for index, b in enumerate(batches):
            floor_graphs.run(index, floor_logits) if floor_graphs is not None else floor_logits(b)

    phases.update(forward=forward, backbone=backbone, calibrate=calibrate)
    phases["forward-floor"] = forward_floor
    if "stage2" in names or "stage2-eager" in names:
        maps = calibrate()
        adapters = ResidualAdapters(parts, rank=cfg.rank, seed=cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed)
        b_start = [1e-3 * torch.randn(b.shape, generator=gen) for b in adapters.B]
        groups = block_groups(parts.num_blocks, cfg.groups)
        graphs = batch_graphs(parts, adapters, batches) if cfg.cuda_graphs else None  # captured in warm-up

        def stage2_with(graphs: BatchGraphs | None) -> Callable[[], None]:
            def stage2() -> None:
                with adapters:
                    stage2_pass(
                        parts,
                        adapters,
                        maps,
                        batches,
                        b_start,
                        cfg.etas[0],
                        cfg.lam_rel[0],
                        cfg,
                        groups,
                        graphs=graphs,
                    )

            return stage2

        phases["stage2"], phases["stage2-eager"] = stage2_with(graphs), stage2_with(None)

    def full_run():
        short = replace(cfg, max_iters=full_run_iters)
        calibrator = Calibrator(parts, train_items, [], short, pipeline.pad_id)
        run_loca(parts, calibrator, batches, heldout, short, progress=False).result.adapters.detach()

    def lora():
        from ..baselines.lora import LoraSettings, fit_lora

        settings = LoraSettings(rank=32, lrs=[1e-4], epochs=1, seed=cfg.seed)
        fit_lora(parts, batches, heldout, settings, progress=False).unload()

    def mezo_settings():
        from ..baselines.mezo import MezoSettings

        steps = len(batches)
        return MezoSettings(lrs=[1e-3], max_steps=steps, eval_every=steps, seed=cfg.seed, rank=cfg.rank)

    def adapter_mezo():
        from ..baselines.mezo import fit_adapter_mezo

        fit_adapter_mezo(parts, batches, heldout, mezo_settings(), progress=False).restore()

    def mezo():
        from ..baselines.mezo import fit_mezo

        fit_mezo(parts, batches, heldout, mezo_settings(), progress=False).restore()

    phases.update({"full-run": full_run, "lora": lora, "adapter-mezo": adapter_mezo, "mezo": mezo})
    return {name: phases[name] for name in names}


def ratio_table(rows: list[dict], tokens: int) -> str:
    """A Markdown table shaped like the paper's Table 2: each phase's time and memory, and its
    ratios to the floor (``forward-floor``, the best inference forward) and to LoRA (where they
    were measured)."""
    by = {r["phase"]: r for r in rows}
    head = "| phase | time (s) | × floor | × LoRA | peak MB | × floor | × LoRA | median MB | tokens/s |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]

    def ratio(r: dict, base: str, key: str) -> str:
        b = by.get(base)
        return f"{r[key] / b[key]:.2f}" if b and b[key] > 0 and r is not b else "—"

    for r in rows:
        passes = PASSES.get(r["phase"])
        tps = f"{tokens * passes / r['time_s']:,.0f}" if passes and r["time_s"] > 0 else "—"
        cells = [
            r["phase"],
            f"{r['time_s']:.3f}",
            ratio(r, "forward-floor", "time_s"),
            ratio(r, "lora", "time_s"),
            f"{r['peak_mb']:.1f}",
            ratio(r, "forward-floor", "peak_mb"),
            ratio(r, "lora", "peak_mb"),
            f"{r['median_mb']:.1f}",
            tps,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
