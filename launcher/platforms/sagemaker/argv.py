"""SageMaker's argv: AWS's rendering of hyperparameters, the repair of a split argv, and the launcher's
options read back from it (the "SageMaker form").

AWS's toolkit (``sagemaker_training.mapping.to_cmd_args``) turns ``hyperparameters.json`` into the
entry point's argv: decode each value as JSON (else keep the text), drop ``sagemaker_*`` keys,
``_tuning_objective_metric`` and ``default_user_module_name`` (``params.SAGEMAKER_HYPERPARAMETERS``),
sort the keys, write ``--key value`` (``-k`` for a one-letter key), a dict as ``a=1,b=2`` and
anything else as Python's ``str()`` (``None`` as an empty string).

Toolkits before 5.1.4 joined that argv into one shell string, so ``"name": "a b"`` reached the
script as two words. :func:`repair_split_argv` recognises exactly that damage and rebuilds the
argv from the file.

The SageMaker form, where the launcher is the estimator's ``entry_point`` and the script is a
hyperparameter: AWS renders the hyperparameters as ``--key value`` *pairs*, sorted by key, always a
key and then exactly one value (an empty word for ``None``): ``--epochs 25 --launcher-grace-period 30
--lr 0.1 --train-script train.py``. An argv that, read as such pairs from its first word, has the key
``--train-script`` (or ``--train_script``) is the SageMaker form (:func:`is_pairs_form`). Its launcher
options live in their own namespace, so no hyperparameter of a training script can collide with them:
``train-script`` and keys starting ``launcher-`` or ``launcher_`` (``launcher-grace-period``,
``launcher_nproc_per_node``, ``launcher-dry-run`` with ``True`` or ``False``, ...); an unknown
``launcher-`` key is an error. Every other pair reaches the script exactly as AWS rendered it, in
order: a value is never read as an option, whatever it looks like (a hyperparameter
``{"mode": "--launcher-dry-run"}`` is the script's business). A launcher key given twice
(``launcher-grace-period`` and ``launcher_grace_period``) is an error. :func:`read_pairs` reads it;
:mod:`launcher.options` converts the values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from launcher.errors import ConfigError, shown
from launcher.platforms.base import ArgvPairs

SCRIPT_KEYS = ("--train-script", "--train_script")
OPTION_PREFIXES = ("--launcher-", "--launcher_")  # the SageMaker form's keys for the other options
HELP = ("In the SageMaker form (hyperparameters, --key value pairs) the options are the keys train-script and "
        "launcher-<option> or launcher_<option> (e.g. launcher-grace-period); every other key goes to the script.")
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


def is_pairs_form(argv: Sequence[str]) -> bool:
    """True if ``argv``, read as ``--key value`` pairs from its first word, has the key ``--train-script``."""
    return any(key in SCRIPT_KEYS for key in argv[0::2])


def key_for(name: str) -> str:
    """The hyperparameter that names a launcher option: ``grace_period`` -> ``launcher-grace-period``."""
    return "train-script" if name == "train_script" else "launcher-" + name.replace("_", "-")


def _option_name(key: str, names: Sequence[str]) -> Optional[str]:
    """The option a key names: ``--train-script`` or ``--launcher-<name>``; None for the script's keys."""
    if key in SCRIPT_KEYS:
        return "train_script"
    prefix = next((p for p in OPTION_PREFIXES if key.startswith(p)), None)
    if prefix is None:
        return None
    name = key[len(prefix):].replace("-", "_")
    if name not in names:
        raise ConfigError(f"unknown launcher hyperparameter {shown(key)} (known: train-script, "
                          f"{', '.join(key_for(n) for n in names if n != 'train_script')})")
    return name


def read_pairs(argv: Sequence[str], names: Sequence[str]) -> Optional[ArgvPairs]:
    """The launcher's options (``names``) and the script's pairs, in order; None if not the SageMaker form."""
    if not is_pairs_form(argv):
        return None
    found: dict[str, str] = {}
    options: list[tuple[str, str, Optional[str]]] = []
    rest: list[str] = []
    for i in range(0, len(argv), 2):
        key, pair = argv[i], argv[i:i + 2]
        name = _option_name(key, names)
        if name is None:
            rest.extend(pair)
            continue
        if name in found:
            raise ConfigError(f"launcher hyperparameter given twice: {found[name]} and {shown(key)}")
        found[name] = key
        options.append((name, key, pair[1] if len(pair) == 2 else None))
    return ArgvPairs(tuple(options), tuple(rest))
