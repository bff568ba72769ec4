"""SageMaker hyperparameters: AWS's rendering into argv, and the repair of a split argv.

AWS's toolkit (``sagemaker_training.mapping.to_cmd_args``) turns ``hyperparameters.json`` into the
entry point's argv: decode each value as JSON (else keep the text), drop ``sagemaker_*`` keys,
``_tuning_objective_metric`` and ``default_user_module_name`` (``params.SAGEMAKER_HYPERPARAMETERS``),
sort the keys, write ``--key value`` (``-k`` for a one-letter key), a dict as ``a=1,b=2`` and
anything else as Python's ``str()`` (``None`` as an empty string).

Toolkits before 5.1.4 joined that argv into one shell string, so ``"name": "a b"`` reached the
script as two words. :func:`repair_split_argv` recognises exactly that damage and rebuilds the
argv from the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional

DROPPED_KEYS = frozenset({"_tuning_objective_metric", "default_user_module_name"})
SAGEMAKER_PREFIX = "sagemaker_"


def decode(raw: Mapping[str, str]) -> dict[str, Any]:
    """Decode ``hyperparameters.json`` values as the toolkit does: JSON if it parses, else text."""
    decoded = {}
    for key, value in raw.items():
        try:
            decoded[key] = json.loads(value)
        except (TypeError, ValueError, RecursionError):  # not JSON, or nested too deeply to decode
            decoded[key] = value
    return decoded


def user_hyperparameters(decoded: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters meant for the user's code (AWS's own ``sagemaker_*`` keys removed)."""
    return {k: v for k, v in decoded.items()
            if not k.startswith(SAGEMAKER_PREFIX) and k not in DROPPED_KEYS}


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def render_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    """The argv AWS's toolkit gives the entry point for these (decoded, user) hyperparameters."""
    argv: list[str] = []
    for key in sorted(hyperparameters):
        name = _text(key)
        argv.append(("--" if len(name) > 1 else "-") + name if name else "")
        value = hyperparameters[key]
        if isinstance(value, Mapping):
            argv.append(",".join(f"{k}={v}" for k, v in sorted(value.items())))
        else:
            argv.append(_text(value))
    return argv


def repair_split_argv(received: Sequence[str], raw: Mapping[str, str]) -> Optional[list[str]]:
    """The argv AWS meant to send, if ``received`` is it split at white space; else ``None``.

    ``raw`` is the content of ``hyperparameters.json``. Nothing is changed unless the received argv
    is exactly the rendered argv joined with spaces and split again, and differs from it.
    """
    expected = render_args(user_hyperparameters(decode(raw)))
    if list(received) == expected:
        return None
    if list(received) == " ".join(expected).split():
        return expected
    return None
