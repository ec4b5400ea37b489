"""asyncrl: fully asynchronous RL for reasoning language models, orchestrated by Prefect.

The repository root is this package: ``flows`` (Prefect flows and the CLI),
``tasks`` (rollout, reward, trainer and data stages), ``storage`` (shards, weights,
ledger, lineage) and ``configs`` (the validated run config and its YAML files).
"""

__version__ = "0.1.0"
