"""asyncrl: fully asynchronous RL for reasoning language models, orchestrated by Prefect.

The repository root is this package. From the top layer down (``lint-imports`` holds the
order, ``pyproject.toml`` names it):

- ``cli``: the ``asyncrl`` command; ``bench`` and ``chaos``: the benchmarks and the chaos
  harness it runs;
- ``flows``: the Prefect flows and deployments, the only code that touches Prefect;
- ``tasks``: the pipeline's stages, the RL run's launch, and the components (rollout server
  and client, scheduler, reward service, trainer, evaluator) with what they share
  (algorithm, model, data, placement, tracking, system);
- ``configs``: the validated run config and its YAML files;
- ``storage``: the run root where components meet (shards, ledger, weights, lineage),
  importing nothing above it.

``examples`` holds user code (an agent episode); ``infra`` the scripts that start the stack.
"""

__version__ = "0.1.0"
