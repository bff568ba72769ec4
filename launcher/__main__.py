"""``python -m launcher``: see :mod:`launcher.cli`."""

import sys

from launcher.cli import main

sys.exit(main())
