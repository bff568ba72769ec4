"""The exceptions that end a launch before torchrun starts (bad input; a stop signal during a wait), how a
bad value is quoted, and how a number is read from text with a bound (no input reaches Python's
integer-digit limit)."""

from typing import Optional

MAX_DIGITS = 18  # no count, rank, port or job number has more digits; more is garbage, not a number
MAX_SHOWN = 200  # characters of a bad value an error message quotes (a 10,000-host list is not shown whole)


class ConfigError(Exception):
    """Bad input: a file, variable or option with a value the launcher cannot use.

    The message is one line that names the file or variable and the bad value. The command line
    turns it into exit code 2 before anything is started.
    """


class Stopped(Exception):
    """A stop signal (``signum``) came while the launcher waited, before torchrun started: the launch ends
    as ``stopped``, exit code 128 + ``signum``. The message is one line that says what it waited for."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with the total length named."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def digits_value(text: str, max_digits: int = MAX_DIGITS) -> Optional[int]:
    """``text`` (surrounding blanks ignored) as a whole number if it is 1 to ``max_digits`` ASCII digits;
    None for anything else, a 5000-digit number included."""
    text = text.strip()
    if not text or len(text) > max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)
