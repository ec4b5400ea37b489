"""The evaluator: held-out pass@1 of every K-th weight version while a run trains, on a vLLM
server of its own at low CPU priority, so generation and training never wait for it. Its
results meet the rest of the run only in the run root (``evaluations/``,
:mod:`asyncrl.storage.evaluations`). The process is :mod:`~asyncrl.tasks.evaluator.main`.
"""
