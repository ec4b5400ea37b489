"""A user's own reward function, named by import path, called with the pool's timeouts.

Contract: ``f(response: str, reference, **metadata)`` returns a finite number (the
reward, reason ``ok``), a ``(reward, reason)`` pair whose reason is a
:class:`~asyncrl.tasks.reward.types.Reason` value, or a ``RewardResult``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.tasks.reward.types import Reason, RewardRequest, RewardResult, failure

RewardFunction = Callable[..., Any]


def load_plugin(spec: str, where: str = "plugin.function") -> RewardFunction:
    """Import ``package.module:function`` or ``/path/to/file.py:function``.

    Raises ValueError naming ``where`` (the config field, e.g. ``reward.plugins.judge.function``),
    the spec and what failed (module, attribute, callable).
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{where}: {spec!r} must look like 'package.module:function' or '/path/file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"{where}: file {str(path)!r} of {spec!r} does not exist")
            module_spec = importlib.util.spec_from_file_location(f"asyncrl_reward_plugin_{path.stem}", path)
            if module_spec is None or module_spec.loader is None:
                raise ValueError(f"{where}: cannot load {str(path)!r} as a Python module")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the spec named
        raise ValueError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    function = getattr(module, attr, None)
    if function is None:
        raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    if not callable(function):
        raise ValueError(f"{where}: {spec!r} is a {type(function).__name__}, not a function")
    return function


def score_plugin(function: RewardFunction, request: RewardRequest) -> RewardResult:
    """Call the user's function; an exception or a malformed return value is a verifier_error."""
    start = time.monotonic()
    try:
        value = function(request.response, request.reference, **request.metadata)
    except Exception as exc:  # noqa: BLE001 - reported with its type, message and location
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return failure(
            Reason.VERIFIER_ERROR,
            f"plug-in {request.plugin!r} raised {type(exc).__name__}: {exc} ({where.filename}:{where.lineno})",
            time.monotonic() - start,
        )
    return normalise_plugin_value(value, time.monotonic() - start)


def normalise_plugin_value(value: Any, elapsed_s: float) -> RewardResult:
    """A RewardResult from what the plug-in returned (module docstring contract)."""
    if isinstance(value, RewardResult):
        return value
    reason: Reason = Reason.OK
    if isinstance(value, tuple):
        if len(value) != 2:
            return failure(Reason.VERIFIER_ERROR, f"plug-in returned a tuple of {len(value)}, expected (reward, reason)", elapsed_s)
        value, label = value
        try:
            reason = Reason(label)
        except ValueError:
            allowed = [r.value for r in Reason]
            return failure(Reason.VERIFIER_ERROR, f"plug-in returned reason {label!r}; allowed: {allowed}", elapsed_s)
    if not isinstance(value, numbers.Real):
        return failure(
            Reason.VERIFIER_ERROR,
            f"plug-in returned {type(value).__name__}, expected a number, (number, reason) or RewardResult",
            elapsed_s,
        )
    reward = float(value)
    if not math.isfinite(reward):
        return failure(Reason.VERIFIER_ERROR, f"plug-in returned a non-finite reward {reward}", elapsed_s)
    return RewardResult(reward=reward, reason=reason, elapsed_s=elapsed_s)
