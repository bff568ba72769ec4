"""The command's front door (``ddp-launcher``, ``python -m launcher``, the zipapp): the Python is checked first.

This file parses on every Python from 2.7 on (no f-strings, annotations or newer syntax): a Python older
than :data:`SUPPORTED` gets one line naming itself and exit code 2, never a ``SyntaxError`` traceback from
a module it cannot read. Only then is :mod:`launcher.cli` imported.
"""

import sys

SUPPORTED = (3, 9)
BAD_INPUT_CODE = 2  # as launcher/codes.py: nothing was started


def too_old(version=None, executable=None):
    """The one-line error for a Python older than :data:`SUPPORTED`, or None for a supported one."""
    version = tuple(sys.version_info[:3] if version is None else version)
    if version >= SUPPORTED:
        return None
    return ("ddp-launcher: error: Python %d.%d or newer is needed; %s is Python %s "
            "(start the launcher with a newer Python, the one that has torch)"
            % (SUPPORTED[0], SUPPORTED[1], executable or sys.executable or "this Python",
               ".".join(str(part) for part in version)))


def main(argv=None):
    """Check the Python, then run :func:`launcher.cli.main`. Returns the exit code."""
    error = too_old()
    if error:
        sys.stderr.write(error + "\n")
        return BAD_INPUT_CODE
    from launcher.cli import main as cli_main

    return cli_main(argv)
