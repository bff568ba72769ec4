"""``python -m launcher``: see :mod:`launcher.entry` (the Python is checked first) and :mod:`launcher.cli`."""

import sys

from launcher.entry import main

sys.exit(main())
