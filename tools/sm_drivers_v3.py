"""Write the ``sm_drivers`` channel a SageMaker SDK 3.x ``ModelTrainer`` uploads, with the SDK's own code.

Run it with the SDK 3.x environment's Python (``make test`` creates ``.venv-v3``)::

    .venv-v3/bin/python tools/sm_drivers_v3.py DIR [--entry-script launch.py]

``DIR`` then holds what ``ModelTrainer._create_training_job_args`` puts in the channel for
``SourceCode(source_dir=..., entry_script=...)`` without ``distributed=``: a copy of the installed
``sagemaker/train/container_drivers/``, sagemaker-core's ``install_requirements.py``, and the
``sm_train.sh``, ``sourcecode.json`` and ``distributed.json`` the SDK's own methods generate. Then
``python -m launcher simulate --sdk v3 --sm-drivers DIR ...`` runs a job through them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import types
from typing import Optional


def write_drivers(dest: str, entry_script: str, source_dir: str) -> str:
    """Fill ``dest`` (new or empty) as ModelTrainer fills its sm_drivers directory; returns ``dest``."""
    import sagemaker.core.utils.install_requirements as install_requirements
    from sagemaker.core.training.configs import SourceCode
    from sagemaker.train.constants import SM_DRIVERS_LOCAL_PATH
    from sagemaker.train.model_trainer import ModelTrainer

    if os.path.isdir(dest) and os.listdir(dest):
        raise FileExistsError(f"not empty: {dest!r}")
    shutil.copytree(SM_DRIVERS_LOCAL_PATH, dest, dirs_exist_ok=True)  # caches included, as the SDK copies
    shutil.copy2(install_requirements.__file__, os.path.join(dest, "scripts", "install_requirements.py"))
    source_code = SourceCode(source_dir=source_dir, entry_script=entry_script)
    tmp = types.SimpleNamespace(name=dest)  # the methods take a TemporaryDirectory: only .name is read
    trainer = types.SimpleNamespace(hyperparameters={}, _jumpstart_config=None)  # what they read of self
    ModelTrainer._prepare_train_script(trainer, tmp_dir=tmp, source_code=source_code, distributed=None)
    ModelTrainer._write_source_code_json(trainer, tmp_dir=tmp, source_code=source_code)
    ModelTrainer._write_distributed_json(trainer, tmp_dir=tmp, distributed=None)
    return dest


def main(argv: Optional[list[str]] = None) -> int:
    """Command line: ``DIR [--entry-script NAME] [--source-dir DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest")
    parser.add_argument("--entry-script", default="launch.py")
    parser.add_argument("--source-dir", default=".", help="only recorded in sourcecode.json")
    args = parser.parse_args(argv)
    try:
        write_drivers(args.dest, args.entry_script, args.source_dir)
    except ImportError as exc:
        sys.stderr.write(f"sm_drivers_v3: needs the SageMaker SDK 3.x (run it with .venv-v3/bin/python): {exc}\n")
        return 2
    except OSError as exc:
        sys.stderr.write(f"sm_drivers_v3: {exc}\n")
        return 2
    print(args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
