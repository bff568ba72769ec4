"""The training script of the notebooks' heterogeneous job: it branches on its instance group.

Every group of a heterogeneous SageMaker job runs the same script. On the training group's hosts the
launcher starts it under torchrun (``RANK`` is set) and it runs ``train_resnet.py``. On a host outside
the training groups the launcher runs it once, without torchrun: there it stands for a data server
(it would prepare and serve data to ``MASTER_ADDR``'s training world) and waits until the launcher
stops it with SIGTERM when every training host is done; exiting 0 then ends the job cleanly.
"""

import os
import runpy
import signal
import sys
import time

if "RANK" in os.environ:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.argv[0] = os.path.join(here, "train_resnet.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(0))
    print(f"group {os.environ.get('SM_CURRENT_INSTANCE_GROUP')} on {os.environ.get('SM_CURRENT_HOST')}: serving "
          f"the training world of {os.environ.get('MASTER_ADDR')} until it ends", flush=True)
    while True:
        time.sleep(1)
