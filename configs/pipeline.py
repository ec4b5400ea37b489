"""The ``pipeline`` section: the stages around RL (data, warm start, evaluation, registry)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.trainer import OptimizerConfig
from asyncrl.configs.synthetic_specs import ArithmeticSpec, SolutionStyle
from asyncrl.configs.synthetic_specs import DEFAULT_OPERATIONS, CodeSpec, ProgramStyle, StepName


class SyntheticDataConfig(StrictModel):
    """Size and difficulty of a synthetic task: ``task: arithmetic`` (see ``ArithmeticSpec``,
    the default) or ``task: code`` (list-processing programs checked by stdin/stdout tests,
    see ``CodeSpec``). Each task refuses the other task's fields when they are set to
    anything but their defaults."""

    task: Literal["arithmetic", "code", "tool"] = Field(
        "arithmetic", description="Which synthetic task prepare-data writes (and which reward scores it)."
    )
    """``arithmetic`` (rows ``prompt``/``answer``/``solution``, math reward), ``code`` (rows
    ``prompt``/``tests``/``solution``/``task``, code reward) or ``tool`` (calculator problems
    for ``examples/calculator.py``: rows ``prompt``/``answer``, warm-start rows with a
    ``conversation``, math reward)."""
    n_train: int = Field(4000, ge=1, description="Training (RL) problems written to data.train_path.")
    n_heldout: int = Field(200, ge=1, description="Held-out problems written to data.eval_path.")
    min_steps: int = Field(
        ArithmeticSpec.min_steps, ge=1, description="Fewest steps of a problem (2 for arithmetic, 1 for code)."
    )
    """Steps: operators (arithmetic) or list operations (code)."""
    max_steps: int = Field(ArithmeticSpec.max_steps, ge=1, description="Most steps of a problem (16 for arithmetic, 4 for code).")
    """P(k steps) is proportional to k ** -step_exponent."""
    step_exponent: float = Field(
        ArithmeticSpec.step_exponent, ge=0.0, description="P(k steps) is proportional to k ** -step_exponent."
    )
    mul_prob: float = Field(
        ArithmeticSpec.mul_prob, ge=0.0, le=1.0, description="Arithmetic: chance of `*` for each operator (else `+` or `-`)."
    )
    max_addend: int = Field(
        ArithmeticSpec.max_addend, ge=1, description="Arithmetic: `+`/`-` operands are drawn from [1, max_addend]."
    )
    max_factor: int = Field(
        ArithmeticSpec.max_factor, ge=2, description="Arithmetic: `*` operands are drawn from [2, max_factor]."
    )
    solution_style: SolutionStyle = Field(
        ArithmeticSpec.solution_style,
        description="Arithmetic: how demonstrations write the steps: `lines`, `worked` (in words) or `tally`.",
    )
    """``worked`` writes each step out in words, about 85 tokens a step; ``tally`` names each
    term of the prompt by a letter and keeps a tally line a term (``b-2: 7 - 2 = 5``), so 9-16
    steps run to 150-295 tokens; both make generation dominate a step, as in reasoning RL."""
    max_total: int | None = Field(
        ArithmeticSpec.max_total, ge=1, description="Arithmetic: keep every running total in [0, max_total] (null: unbounded)."
    )
    n_tests: int = Field(
        CodeSpec.n_tests, ge=2, description="Code: stdin/stdout tests per problem, each on a random list of integers."
    )
    min_list_len: int = Field(CodeSpec.min_list_len, ge=1, description="Code: shortest input list of a test.")
    max_list_len: int = Field(
        CodeSpec.max_list_len, ge=1, description="Code: longest input list of a test (lengths uniform in between)."
    )
    max_value: int = Field(CodeSpec.max_value, ge=1, description="Code: input integers are drawn from [0, max_value].")
    max_constant: int = Field(
        CodeSpec.max_constant, ge=1, le=9, description="Code: constants of the steps are drawn from [1, max_constant]."
    )
    """The steps' constants: add k, times k, keep >k ..."""
    operations: tuple[StepName, ...] = Field(  # type: ignore[assignment]
        DEFAULT_OPERATIONS, description="Code: the list operations problems draw from, uniformly."
    )
    """Names of ``tasks/data/synthetic_code.py`` STEPS: the default nine (sort, reverse, evens,
    odds and add/sub/mul/above/below, which take a constant) or any others, e.g. the
    constant-free double, square, increment, decrement, halve, negate, last_digit."""
    n_sft: int = Field(0, ge=0, description="Warm-start problems written to data.sft_path, distinct from the RL and held-out ones.")
    """Distinct from the RL prompts (data.train_path) and the held-out split, so RL and
    evaluation see unseen problems."""
    sft_answer_only_share: float = Field(
        0.0, ge=0.0, le=1.0, description="Arithmetic: share of warm-start solutions giving only the final answer."
    )
    """Only the final-answer line, no worked steps (a mixed-quality demonstration set, like many
    real SFT mixtures)."""
    sft_tool_share: float = Field(
        0.5, ge=0.0, le=1.0, description="Tool: share of the warm-start demonstrations that call the `calc` tool."
    )
    """The others answer at once (:mod:`asyncrl.tasks.data.synthetic_tool`)."""
    sft_styles: dict[ProgramStyle, Annotated[float, Field(ge=0.0)]] | None = Field(
        None, description="Code: the warm-start programs' styles and their weights; None: all `lines`."
    )
    """E.g. ``{commented: 0.5, nested: 0.5}``: ``lines`` (one line per step), ``commented``
    (each step's phrase as a comment above its line), ``nested`` (one expression, inside out);
    all correct (a mixed-style demonstration set)."""

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, data: Any) -> Any:  # noqa: ANN401 - the raw section
        """The code task's own defaults for the step fields it shares with arithmetic."""
        if isinstance(data, dict) and data.get("task") == "code":
            return {"min_steps": CodeSpec.min_steps, "max_steps": CodeSpec.max_steps,
                    "step_exponent": CodeSpec.step_exponent, **data}
        return data

    @model_validator(mode="after")
    def _steps_ordered(self) -> SyntheticDataConfig:
        if self.min_steps > self.max_steps:
            raise ValueError(
                f"pipeline.synthetic_data.min_steps ({self.min_steps}) must be <= max_steps ({self.max_steps})"
            )
        for task, names in _TASK_ONLY_FIELDS.items():
            for name in names if task != self.task else ():
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(
                        f"pipeline.synthetic_data.{name}: applies to task {task} only, not to task {self.task!r}; "
                        "remove it"
                    )
        if self.sft_styles is not None and not sum(self.sft_styles.values()) > 0:
            raise ValueError(
                f"pipeline.synthetic_data.sft_styles: the weights must have a positive sum, got {self.sft_styles}"
            )
        if self.task == "code":
            try:
                self.code_spec()
            except ValueError as exc:
                raise ValueError(str(exc).replace("CodeSpec.", "pipeline.synthetic_data.", 1)) from None
        return self

    def spec(self) -> ArithmeticSpec:
        return ArithmeticSpec(
            min_steps=self.min_steps,
            max_steps=self.max_steps,
            step_exponent=self.step_exponent,
            mul_prob=self.mul_prob,
            max_addend=self.max_addend,
            max_factor=self.max_factor,
            solution_style=self.solution_style,
            max_total=self.max_total,
        )

    def code_spec(self) -> CodeSpec:
        """The code task's generator settings (``task: code``)."""
        return CodeSpec(
            min_steps=self.min_steps,
            max_steps=self.max_steps,
            step_exponent=self.step_exponent,
            n_tests=self.n_tests,
            min_list_len=self.min_list_len,
            max_list_len=self.max_list_len,
            max_value=self.max_value,
            max_constant=self.max_constant,
            operations=self.operations,
        )


_ARITHMETIC_ONLY_FIELDS: tuple[str, ...] = (
    "mul_prob", "max_addend", "max_factor", "sft_answer_only_share", "solution_style", "max_total",
)
_CODE_ONLY_FIELDS: tuple[str, ...] = (
    "n_tests", "min_list_len", "max_list_len", "max_value", "max_constant", "operations", "sft_styles",
)
_TASK_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "arithmetic": _ARITHMETIC_ONLY_FIELDS,
    "code": _CODE_ONLY_FIELDS,
    "tool": ("sft_tool_share",),
}



class TrainingEvalConfig(StrictModel):
    """Held-out evaluation while RL runs (``pipeline.eval_every`` > 0): the ``evaluator``
    component (``tasks/evaluator/``) loads every ``eval_every``-th weight version in place
    into a vLLM server of its own and scores the same subset of the held-out prompts, at a
    lower CPU priority than generation and training."""

    prompts: int = Field(
        32, ge=1, description="The first this many held-out prompts (`data.eval_path`), the same ones each time."
    )
    samples: int = Field(2, ge=1, description="Samples per prompt, at `rollout.temperature`; pass@k for k up to this.")
    """pass@k (``tracking.pass_k``) is reported for the k up to this."""
    devices: tuple[int, ...] | None = Field(
        None, description="Device set of the evaluator's vLLM server, as `inference.devices[k]`; None: no placement."
    )
    """``inference.tensor_parallel_size`` ids: GPU ids on a GPU machine, CPU ids (pinning) on one
    without. It runs where the `train` flow runs, so it must not overlap the devices of the
    local components unless ``placement.share_devices``. None: no placement (on a GPU machine
    vLLM then takes the first GPU it sees: give it devices there)."""
    nice: int = Field(10, ge=0, le=19, description="CPU priority (nice value) of the evaluator and its vLLM server.")
    """For the whole of their sessions: above 0 they yield the CPUs to generation and training
    when they compete."""
    reward_workers: int = Field(
        1, ge=1, le=256, description="Processes of the evaluator's own reward pool (the `reward` section's verifiers)."
    )
    """The ``reward`` section's verifiers and limits apply."""
    finish_timeout_s: float = Field(
        300.0, ge=0.0, description="After the last step, wait up to this long for the evaluator's last version."
    )
    """Once the last step is trained, the run waits up to this long for the evaluator to
    evaluate the last multiple of ``eval_every``; then (or at once with 0) it stops it, and a
    version in evaluation is abandoned (the run's log says which)."""

    @field_validator("devices")
    @classmethod
    def _distinct_devices(cls, ids: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if ids is not None and (not ids or len(set(ids)) != len(ids) or min(ids) < 0):
            raise ValueError(f"pipeline.training_eval.devices: {list(ids)} must be distinct device ids >= 0")
        return ids


class PromotionConfig(StrictModel):
    """The register stage's gate: a candidate replaces ``models:/<name>@best`` only when a
    paired bootstrap over the held-out prompts says it is better
    (:func:`asyncrl.tasks.pipeline.promotion.paired_bootstrap`)."""

    min_gain: float = Field(0.0, ge=-1.0, le=1.0, description="Least pass@1 gain over the incumbent (0.01 = 1 point) to promote.")
    confidence: float = Field(0.9, gt=0.5, lt=1.0, description="Promote when P(gain > min_gain) reaches this (paired bootstrap).")
    max_task_regression: float = Field(
        0.02, ge=0.0, le=1.0, description="No task's pass@1 may drop by more than this (0.02 = 2 points) to promote."
    )
    resamples: int = Field(2000, ge=100, description="Bootstrap resamples of the held-out prompts.")
    prompts: int | None = Field(None, ge=1, description="Held-out prompts of the comparison (None: pipeline.eval_prompts).")
    samples: int | None = Field(None, ge=1, description="Samples per prompt of the comparison (None: pipeline.eval_samples).")


class PipelineConfig(StrictModel):
    init_tiny_model: bool = Field(
        False, description="Write the tiny Qwen2 model at model.path when nothing is there (demo, tests)."
    )
    synthetic_data: SyntheticDataConfig | None = Field(
        None, description="Write a synthetic task at the data paths when absent; None: the data is given."
    )
    """The task (arithmetic, code or tool, by its ``task``) is written at data.train_path /
    data.eval_path (/ data.sft_path)."""
    sft_steps: int = Field(0, ge=0, description="Warm-start SFT updates on the reference solutions before RL (0 skips it).")
    sft_batch_size: int = Field(16, ge=1, description="Examples per SFT update.")
    sft_optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer of the SFT stage (learning rate, schedule); None uses trainer.optimizer."
    )
    eval_samples: int = Field(4, ge=1, description="Samples per held-out prompt for pass@1.")
    eval_prompts: int | None = Field(None, ge=1, description="Evaluate on the first this many held-out prompts (None: all).")
    eval_every: int = Field(
        0, ge=0, description="Evaluate every weight version that is a multiple of this while RL runs; 0: off."
    )
    """Held-out pass@1 (``pipeline.training_eval``; MLflow ``eval/pass_at_1`` at step =
    version). Needs ``data.eval_path``."""
    training_eval: TrainingEvalConfig = Field(
        default_factory=TrainingEvalConfig, description="Subset, samples and placement of the evaluation during training."
    )
    registered_model: str = Field(
        "asyncrl-policy", min_length=1, description="MLflow Model Registry name the best version is registered under."
    )
    promotion: PromotionConfig = Field(
        default_factory=PromotionConfig, description="When a run's best version replaces the registered model's `best`."
    )
    """With no ``models:/<registered_model>@best`` yet, the run's best version becomes it."""
