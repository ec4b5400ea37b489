"""The pipeline's batch stages (prepare inputs, SFT warm start, evaluate, register), their
content cache keys and their progress files; ``flows/pipeline.py`` runs them as Prefect tasks."""
