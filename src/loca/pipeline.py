"""One LoCA run as a library object: set-up, calibration, fit, evaluation and the run folder.

Every command uses it (the CLI recipes only parse flags and print), and so can Python code::

    from loca import DataConfig, LocaConfig, ModelConfig, Pipeline
    run = Pipeline(ModelConfig("smollm2-135m-instruct"), DataConfig("sst2", data_dir="data"))
    results = run.run("runs/sst2")  # calibrate, fit forward-only, evaluate; writes the run folder

A run folder holds ``config.json`` (the three configuration sections plus the exact splits,
fingerprint and versions: ``Pipeline.from_run(folder)`` rebuilds the run from it), ``maps/``,
``history.jsonl``, ``adapter/`` (the best snapshot, replaced atomically on every improvement),
``checkpoint/`` while the fit runs (``run(..., resume=True)`` continues from it) and
``results.json`` at the end.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from .config import DataConfig, LocaConfig, ModelConfig, sections_from_dict
from .data import TASKS, Batch, Encoded, Splits, degenerate_warnings, encode_examples, get_task, load_splits
from .data import load_test as load_test_split
from .data.batching import make_batches, pad_token_id, padding_fraction
from .data.encoding import content_fingerprint, count_truncated
from .eval.evaluation import evaluate
from .infra import distributed
from .infra.runs import require_finite
from .infra.versions import versions
from .method.adapters import ResidualAdapters
from .method.artefacts import BASE_KEYS, TASK_KEYS, source_record
from .method.calibrate import Calibrator
from .method.fit import FitResult, check_rank
from .method.maps import FeedbackMaps
from .method.run import LocaRun, RunWriter, calibrate_maps, run_loca
from .method.state import FitState
from .models.parts import ModelParts, clamp_max_length, find_parts, fingerprint, load_model
from .run_folder import RunFolder

log = logging.getLogger("loca")


class Pipeline:
    """A LoCA run from its configuration sections. Data and model load lazily, once; the model
    may also be given (``model_object=`` and ``tokenizer=``) to run on one already in memory.
    ``revision``: the commit, branch or tag to load a hub id at (``loca evaluate --adapter`` passes
    the one the adapter records)."""

    def __init__(
        self,
        model: ModelConfig | None = None,
        data: DataConfig | None = None,
        loca: LocaConfig | None = None,
        *,
        progress: bool = True,
        model_object=None,
        tokenizer=None,
        revision: str | None = None,
    ):
        self.model_config = model or ModelConfig()
        self.data = data or DataConfig()
        self.cfg = loca or LocaConfig()
        self.progress = progress
        self.revision = revision
        self.task = get_task(self.data.task, template=self.data.template)
        self._splits: Splits | None = None
        self._model = None
        self._encoded: tuple[list[Encoded], list[Encoded]] | None = None
        self._truncated: dict[str, int] = {}
        self._batched: tuple[list[Batch], list[Batch]] | None = None
        self._calibrator: Calibrator | None = None
        self._named_model = model_object is None  # loaded from model.model (not given in memory)
        if model_object is not None:
            if tokenizer is None:
                raise ValueError("Pipeline(model_object=...) needs its tokenizer too")
            self._set_model(model_object, tokenizer)

    @classmethod
    def from_run(cls, folder: str | Path, *, trust_remote_code: bool = False, **kwargs) -> Pipeline:
        """The pipeline a run folder's ``config.json`` describes (to rerun or resume it).
        ``trust_remote_code`` is never taken from the folder: a run that was made with it is
        refused unless it is given here again (``--trust-remote-code`` on the command line)."""
        path = Path(folder) / "config.json"
        try:
            obj = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not readable JSON ({exc})") from None
        try:
            s = sections_from_dict(obj)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        model = dict(s.get("model", {}))
        if model.pop("trust_remote_code", False) and not trust_remote_code:
            raise ValueError(
                f"{path}: the run was made with trust_remote_code (Python code shipped with the "
                "model), which is never taken from a run folder; pass --trust-remote-code on the "
                "command line (trust_remote_code=True in Python) to allow it again"
            )
        return cls(
            ModelConfig(**model, trust_remote_code=trust_remote_code),
            DataConfig(**s.get("data", {})),
            LocaConfig(**s.get("loca", {})),
            **kwargs,
        )

    # -- set-up -----------------------------------------------------------------------------
    @property
    def splits(self) -> Splits:
        """The seeded train / held-out / test splits (loaded on first use; warnings logged)."""
        if self._splits is None:
            d = self.data
            self._splits = load_splits(
                self.task,
                n_train=d.n_train,
                n_heldout=d.n_heldout,
                n_test=d.n_test,
                seed=self.cfg.seed,
                data_dir=d.data_dir,
            )
            for message in degenerate_warnings(self._splits):
                log.warning(f"task {self.task.name!r}: {message}")
        return self._splits

    def test_set(self) -> tuple[list, dict]:
        """Only the test examples and their record (the same as ``splits.test``), without drawing
        the training splits."""
        if self._splits is not None:
            return self._splits.test, self._splits.record
        examples, record = load_test_split(
            self.task, n_test=self.data.n_test, seed=self.cfg.seed, data_dir=self.data.data_dir
        )
        for message in degenerate_warnings(Splits(train=[], heldout=[], test=examples)):
            log.warning(f"task {self.task.name!r}: {message}")
        return examples, record

    def load(self) -> Pipeline:
        """Load the model (once) and clamp ``max_length`` to its context."""
        if self._model is None:
            m = self.model_config
            model, tokenizer = load_model(
                m.model,
                device=distributed.local_device(m.device),
                dtype=m.dtype,
                random_init=m.random_init,
                trust_remote_code=m.trust_remote_code,
                device_map=m.device_map,
                revision=self.revision,
            )
            self._set_model(model, tokenizer)
        return self

    def _set_model(self, model, tokenizer) -> None:
        self._model = (model, tokenizer, find_parts(model))
        length, note = clamp_max_length(self.cfg.max_length, model)
        if note:
            log.warning(f"--{note.replace('_', '-', 1)}")
            self.cfg = replace(self.cfg, max_length=length)

    @property
    def model(self):
        return self.load()._model[0]

    @property
    def tokenizer(self):
        return self.load()._model[1]

    @property
    def parts(self) -> ModelParts:
        return self.load()._model[2]

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

    def encode(self, examples) -> list[Encoded]:
        """Prompt + gold completion sequences with the run's max length and EOS setting."""
        return encode_examples(
            self.tokenizer, self.task, examples, max_length=self.cfg.max_length, add_eos=self.cfg.add_eos
        )

    def batches(self, items: list[Encoded]) -> list[Batch]:
        return make_batches(items, self.pad_id, batch_size=self.cfg.batch_size)

    def encoded(self) -> tuple[list[Encoded], list[Encoded]]:
        """The training and held-out sequences (encoded once; truncated prompts counted and warned
        about)."""
        if self._encoded is None:
            s = self.splits
            self._encoded = (self.encode(s.train), self.encode(s.heldout))
            self._truncated = {
                name: count_truncated(self.tokenizer, self.task, examples, items)
                for name, examples, items in (
                    ("train", s.train, self._encoded[0]),
                    ("heldout", s.heldout, self._encoded[1]),
                )
            }
            for name, n in self._truncated.items():
                if n:
                    total = len(s.train if name == "train" else s.heldout)
                    log.warning(
                        f"{n} of {total} {name} prompts were cut from the left to fit --max-length "
                        f"{self.cfg.max_length}; their question may be lost"
                    )
        return self._encoded

    def use_items(self, train: list[Encoded], heldout: list[Encoded]) -> None:
        """Run on these encoded sequences instead of the task's splits (e.g.
        :func:`loca.data.synthetic.synthetic_items` for time and memory runs)."""
        if not train or not heldout:
            raise ValueError("use_items needs training and held-out sequences")
        self._encoded = (list(train), list(heldout))
        self._truncated = {"train": 0, "heldout": 0}
        self._batched = self._calibrator = None

    def data_fingerprint(self) -> str:
        """The content fingerprint of the training and held-out sequences this run fits on
        (:func:`loca.data.encoding.content_fingerprint`): a run folder records it, and a resume
        refuses data whose content changed, whatever their ids."""
        return content_fingerprint(*self.encoded())

    def truncated(self) -> dict[str, int]:
        """How many training and held-out prompts were cut from the left."""
        self.encoded()
        return dict(self._truncated)

    def batched(self) -> tuple[list[Batch], list[Batch]]:
        """The training and held-out batches (built once)."""
        if self._batched is None:
            self._batched = tuple(self.batches(items) for items in self.encoded())
        return self._batched

    # -- Stage I ------------------------------------------------------------------------------
    @property
    def calibrator(self) -> Calibrator:
        if self._calibrator is None:
            train, heldout = self.encoded()
            self._calibrator = Calibrator(
                self.parts, train, heldout, self.cfg, self.pad_id, progress=self.progress
            )
        return self._calibrator

    def calibrate(self) -> FeedbackMaps:
        """Stage I: the feedback maps, recording the task and splits they were calibrated on."""
        return calibrate_maps(self.calibrator, *self.batched(), self.cfg, self._maps_meta())

    def _maps_meta(self) -> dict:
        return {"task": self.task.name, "splits": self.splits.record}

    def load_maps(self, directory: str | Path) -> FeedbackMaps:
        """Maps saved by ``loca calibrate`` (or a fit), checked against this run: the same
        checkpoint, the same task, and no probe example among this run's held-out or test ones.
        The run's ``feedback_rank``, ``feedback_gate`` and ``beta_rel`` become the maps'."""
        maps = FeedbackMaps.from_pretrained(directory, self.parts)
        check_maps_data(maps, self.task.name, self.splits, str(directory))
        self.cfg = replace(
            self.cfg,
            feedback_rank=maps.rank,
            feedback_gate=maps.gate,
            beta_rel=maps.meta.get("beta_rel", self.cfg.beta_rel),
        )
        self._calibrator = None  # built again with the maps' settings
        return maps

    # -- Stage II -----------------------------------------------------------------------------
    def fit(
        self,
        maps: FeedbackMaps | None = None,
        *,
        resume: FitState | None = None,
        writer: RunWriter | None = None,
    ) -> LocaRun:
        """The LoCA run (:func:`loca.method.run.run_loca`) on the run's data: calibrate unless
        ``maps`` are given, then fit forward-only; ``writer`` receives its progress."""
        return run_loca(
            self.parts,
            self.calibrator,
            *self.batched(),
            self.cfg,
            maps=maps,
            meta=self._maps_meta(),
            resume=resume,
            writer=writer,
            progress=self.progress,
        )

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, examples=None, adapters: ResidualAdapters | None = None) -> dict:
        """Test metrics (:func:`loca.eval.evaluation.evaluate`) of the model as it is, or with
        ``adapters`` attached for the call; ``examples`` default to the test split."""
        examples = self.test_set()[0] if examples is None else examples
        args = dict(
            max_length=self.cfg.max_length,
            batch_size=self.cfg.batch_size,
            add_eos=self.cfg.add_eos,
            progress=self.progress,
        )
        with torch.no_grad():
            if adapters is None or adapters.attached:
                return evaluate(self.parts, self.tokenizer, self.task, examples, **args)
            with adapters:
                return evaluate(self.parts, self.tokenizer, self.task, examples, **args)

    # -- the whole run ------------------------------------------------------------------------
    def record(self, maps_path: str | None = None) -> dict:
        """The run's ``config.json``: the sections, then what they resolved to."""
        return {
            "command": "fit",
            "model": self.model_config.to_dict(),
            "data": self.data.to_dict(),
            "loca": self.cfg.to_dict(),
            "maps": maps_path,
            "task": self.task.describe(),
            "splits": self.splits.record,
            "data_fingerprint": self.data_fingerprint(),
            "device": str(self.parts.device),
            "distributed": distributed.describe(str(self.parts.device)),
            "fingerprint": fingerprint(self.parts),
            "versions": versions(),
        }

    def adapter_record(self) -> dict:
        """What the run's adapter config records of what it was fitted on, so that
        :func:`loca.load_adapted`, ``loca generate --adapter`` and ``loca evaluate --adapter`` find
        it again: the base model as named (``base_model``, plus ``base_model_path`` for a local
        folder; only when this pipeline loaded it by name, else the adapter's own record of the
        model's ``_name_or_path`` stays), the task's name, its source as given (``task_source``,
        ``task_path``), its template and ``add_eos``."""
        named = source_record(self.model_config.model, BASE_KEYS) if self._named_model else {}
        task = self.data.task if isinstance(self.data.task, str) else (self.task.path or self.task.name)
        return {
            **named,
            "task": self.task.name,
            **source_record(task, TASK_KEYS, local=task not in TASKS),
            "template": self.task.template,
            "add_eos": self.cfg.add_eos,
        }

    def run(
        self,
        out: str | Path | None = None,
        *,
        maps: str | Path | None = None,
        resume: bool = False,
        overwrite: bool = False,
    ) -> dict:
        """Calibrate (or load ``maps``), fit, evaluate LoCA and the frozen model on the test set;
        with ``out``, write the run folder as the fit goes. ``resume`` continues an interrupted run
        in ``out`` (built by :meth:`from_run`) from its last completed iteration, on the same data
        and settings only. ``overwrite`` replaces an earlier run in ``out``: this run is written
        beside it (a staging folder) and replaces it only once it has finished."""
        start = time.perf_counter()
        out = Path(out) if out is not None else None
        main = out is not None and distributed.is_main()  # data-parallel: rank 0 writes
        target = out  # where this run's files go: ``out``, or a staging folder swapped in at the end
        if resume:
            maps = RunFolder.unfinished(out)
        elif main:
            target = RunFolder.prepare(out, self.model_config.model, overwrite)
        distributed.barrier()
        try:
            results = self._run(out, target, maps, resume, main, start)
        except BaseException:
            if main and target != out:
                RunFolder.discard(target)  # the earlier run stays as it was
            raise
        if main and target != out:
            RunFolder.replace(out, target)
        return results

    def _run(self, out, target, maps, resume: bool, main: bool, start: float) -> dict:
        """:meth:`run` once the folder is chosen: ``target`` receives the files, ``out`` holds the
        run that ``resume`` continues."""
        check_rank(self.cfg.rank, self.parts)  # loads the model; before any work
        if maps is not None and target != out and _inside(Path(maps), out):
            raise ValueError(
                f"--maps {maps} lies inside --out {out}, whose earlier run --overwrite replaces; copy "
                "the maps elsewhere first"
            )
        data = self.data_fingerprint() if main or resume else None
        if resume:
            RunFolder.check_data(out, data)
            if maps is None:
                maps = RunFolder.saved_maps(out)  # calibrated before the interruption
        maps_obj = self.load_maps(maps) if maps else None  # may set the calibration settings
        run = {"model": fingerprint(self.parts), "data": data, "loca": self.cfg.to_dict()}
        state = RunFolder.saved_state(out, self.parts, run) if resume else None
        if state:
            log.info(f"resuming after iteration {state.iteration} of {self.cfg.max_iters}")
        extra = {**self.adapter_record(), "feedback_rank": None, "loca": self.cfg.to_dict()}
        writer = RunFolder(target, extra, state.history if state else [], run) if main else None
        if main and not resume:
            writer.config(self.record(str(maps) if maps else None))
        if main and state:
            writer.history()
        fitted = self.fit(maps_obj, resume=state, writer=writer)
        result = fitted.result
        if self.cfg.max_iters == 0:
            log.info("LoCA: --max-iters 0 runs no Stage II iteration; returning the frozen model (B = 0)")
        elif not result.improved:
            log.info(
                "LoCA: no candidate beat the frozen model on held-out CE; returning the frozen model (B = 0)"
            )
        try:  # the adapters come off again whatever happens
            results = self._results(result, fitted.maps.meta.get("alignment", {}), start)
            if main:
                writer.finish(result.adapters, _selected_row(result), results)
        finally:
            result.adapters.detach()
        return results

    def _results(self, result: FitResult, align: dict, start: float) -> dict:
        """Test metrics of LoCA (adapters attached) and of the frozen model, and the selection;
        non-finite metrics are refused."""
        loca_test = self.evaluate()
        with result.adapters.disable_adapter():
            frozen_test = self.evaluate()
        train, heldout = self.batched()
        results = {
            "task": self.task.name,
            "model": self.model_config.model,
            "frozen": _row(result.frozen_heldout_ce, frozen_test),
            "loca": _row(result.heldout_ce, loca_test),
            "eta": result.eta,
            "lam_rel": result.lam_rel,
            "best_iteration": result.best_iteration,
            "improved": result.improved,
            "stop_reasons": result.stop_reasons,
            "recalibrations": result.recalibrations,
            "recalibration_time_s": result.recalibration_time_s,
            "graph_capture_s": result.graph_capture_s,
            "alignment": align,
            "padding_fraction": {"train": padding_fraction(train), "heldout": padding_fraction(heldout)},
            "truncated_prompts": {**self.truncated(), "test": loca_test["n_truncated"]},
            "fit_wall_time_s": result.wall_time_s,
            "wall_time_s": time.perf_counter() - start,
        }
        for name in ("frozen", "loca"):
            require_finite(results[name], f"the {name} model's evaluation")
        return results


def check_maps_data(maps: FeedbackMaps, task: str, splits: Splits, where: str) -> None:
    """Refuse maps calibrated on another task, or on examples that are this run's held-out or
    test examples (the selection and the test would then see calibration data)."""
    meta = maps.meta
    if "task" not in meta or "splits" not in meta:
        log.warning(
            f"feedback maps {where} do not record their task and splits; cannot check that "
            "their probe is disjoint from this run's held-out and test examples"
        )
        return
    if meta["task"] != task:
        raise ValueError(f"feedback maps {where} were calibrated on task {meta['task']!r}, not {task!r}")
    probe_ids = set(meta["splits"].get("train", {}).get("ids", []))
    for part in ("heldout", "test"):
        rec = splits.record.get(part) or {}
        overlap = probe_ids & set(rec.get("ids", []))
        if overlap:
            raise ValueError(
                f"feedback maps {where} were calibrated on {len(overlap)} of this run's "
                f"{'held-out' if part == 'heldout' else part} examples "
                f"(e.g. id {sorted(overlap)[0]!r}): calibrate with this run's --seed, --n-train and "
                "--n-heldout, or fit with the maps' settings"
            )


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it."""
    p, f = path.resolve(), folder.resolve()
    return p == f or f in p.parents


def _selected_row(result: FitResult) -> dict | None:
    """The history row of the selected candidate (None when the frozen model won)."""
    if not result.improved:
        return None
    rows = [
        r
        for r in result.history
        if r.get("iteration") == result.best_iteration
        and r.get("heldout_ce") == result.heldout_ce
        and "diagnostic" not in r
    ]
    return rows[-1] if rows else None


def _row(heldout_ce: float, test: dict) -> dict:
    return {
        "heldout_ce": heldout_ce,
        "test_ce": test["test_ce"],
        "test_ce_no_eos": test["test_ce_no_eos"],
        "test_acc": test["acc"],
        "test_acc_norm": test["acc_norm"],
        "n_test": test["n_test"],
    }
