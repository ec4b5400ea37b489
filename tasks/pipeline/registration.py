"""The pipeline's ``register`` stage: the run's best version registered so that it loads
through MLflow, and promoted to ``models:/<name>@best`` only through the gate
(:mod:`asyncrl.tasks.pipeline.promotion`): the incumbent and the candidate evaluated together
on the same held-out prompts, the decision written on the candidate's model version
(:mod:`asyncrl.tasks.tracking.promotion_registry`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.evaluations import EvalResult
from asyncrl.storage.fs import open_root
from asyncrl.tasks.pipeline.promotion import PromotionDecision, decide, first_version
from asyncrl.tasks.pipeline.stages import evaluate_runs
from asyncrl.tasks.system.run_paths import RunPaths, run_paths
from asyncrl.tasks.tracking.lineage_recorder import file_ref
from asyncrl.tasks.tracking.mlflow_run import RunLineage
from asyncrl.tasks.tracking.model_registry import register_version
from asyncrl.tasks.tracking.promotion_registry import (
    CANDIDATE_ALIAS, PROMOTED_ALIASES, RegisteredWeights, aliased_version, record_decision,
)  # fmt: skip


@dataclass(frozen=True)
class Registration:
    """What the stage did: the run's best weight version, its registered version number, and
    the gate's decision (None when nothing was registered)."""

    best_version: int | None
    registered_version: str | None
    decision: PromotionDecision | None


def comparison_config(config: RunConfig, incumbent: RegisteredWeights | None = None) -> RunConfig:
    """The run config of one side of the gate's evaluation: the held-out prompts and samples
    of ``pipeline.promotion`` (else the evaluate stage's); with ``incumbent``, the incumbent's
    run root, under a work directory of its own beside the run's."""
    settings = config.pipeline.promotion
    data = config.model_dump()
    data["pipeline"]["eval_prompts"] = settings.prompts or config.pipeline.eval_prompts
    data["pipeline"]["eval_samples"] = settings.samples or config.pipeline.eval_samples
    if incumbent is not None:
        data["name"] = f"{config.name}-incumbent"
        data["storage"]["root"] = incumbent.root_and_version()[0]
    return RunConfig.model_validate(data)


def evaluate_pair(config: RunConfig, paths: RunPaths, incumbent: RegisteredWeights, version: int) -> tuple[EvalResult, EvalResult]:
    """(incumbent, candidate): both evaluated in one evaluation, on one server, the same prompts
    and samples; the server starts from the candidate (weight ``version`` of the run) and loads
    the incumbent's weights from its run root."""
    mine, theirs = comparison_config(config), comparison_config(config, incumbent)
    inc_version = incumbent.root_and_version()[1]
    candidate, held = evaluate_runs([(mine, paths, [version]), (theirs, run_paths(theirs), [inc_version])])
    return held[inc_version], candidate[version]


def is_untrained_start(config: RunConfig, version: int) -> bool:
    """Whether weight ``version`` is the run's start as given (``model.path``, no SFT): version 0
    of a run without a warm start. A scheduled run starts from the incumbent's own weights, so
    when that version is its best, the run trained nothing better and has no candidate."""
    return version == 0 and config.pipeline.sft_steps == 0


def candidate_results(config: RunConfig, results: dict[int, EvalResult], gated: bool) -> list[EvalResult]:
    """The versions the run's candidate is chosen from. Behind the gate (``gated``: an ``@best``
    exists), a run's untrained start (:func:`is_untrained_start`, the incumbent's own weights)
    is no candidate while any trained version was evaluated: a night that made the model worse
    registers its best trained version, which the gate then rejects with the figures."""
    trained = [r for r in results.values() if not is_untrained_start(config, r.version)]
    return trained if gated and trained else list(results.values())


def register_best(
    config: RunConfig, lineage: RunLineage, logged_models: dict[int, str], results: dict[int, EvalResult]
) -> Registration:
    """Link evaluation metrics to each LoggedModel (against the held-out dataset, so the UI's
    model list ranks versions by them); register the run's best version as the candidate
    (alias ``candidate``) through :func:`register_version` (its weights pinned in the run root
    and logged once into its LoggedModel in the transformers flavor, so it loads through
    MLflow); then the gate: with no ``@best`` yet it is promoted; otherwise the incumbent and
    it are evaluated together and :func:`decide` says whether ``best`` and ``current`` move to
    it. The decision is written on the version (tags, description). The candidate is the best
    of :func:`candidate_results`. A re-run of a run whose version is ``@best`` already keeps it
    without a new evaluation; a run that evaluated only its untrained start registers nothing."""
    eval_ref = file_ref(config.data.eval_path, Path(config.data.eval_path).name) if config.data.eval_path else None
    for version, result in results.items():
        model_id = logged_models.get(version)
        if model_id is not None and eval_ref is not None:
            lineage.log_evaluation(model_id, version, result.metrics(), eval_ref)
    if not results:
        return Registration(None, None, None)
    name, uri = config.pipeline.registered_model, config.tracking.mlflow_uri
    incumbent = aliased_version(uri, name, PROMOTED_ALIASES[0])
    best = max(candidate_results(config, results, incumbent is not None), key=lambda r: (r.pass_at_1, r.version))
    model_id = logged_models.get(best.version)
    if model_id is None:
        return Registration(best.version, None, None)
    root = open_root(config.storage.root, config.storage.options)
    base = Path(config.model.path) if config.trainer.lora is not None else None
    if incumbent is not None and is_untrained_start(config, best.version):
        reason = f"no trained version of run {config.name} beat its start (weight version 0); nothing registered"
        return Registration(best.version, None, PromotionDecision(False, reason, f"run {config.name}", incumbent.ref))
    number = register_version(root, lineage, best.version, model_id, name, [CANDIDATE_ALIAS], base_model_dir=base)
    candidate = f"models:/{name}/{number}"
    if incumbent is not None and incumbent.number == number:
        return Registration(best.version, number, PromotionDecision(True, f"{candidate} is @best already (a re-run)", candidate))
    if incumbent is None:
        decision = first_version(candidate)
    else:
        held, mine = evaluate_pair(config, run_paths(config), incumbent, best.version)
        decision = decide(held, mine, (incumbent.ref, candidate), config.pipeline.promotion, config.seed)
    previous = None if incumbent is None else incumbent.number
    record_decision(uri, name, number, decision.tags(), decision.markdown(), decision.promoted, previous)
    return Registration(best.version, number, decision)
