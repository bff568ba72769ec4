"""The one exception the launcher raises for bad input, and how a bad value is quoted in it."""

MAX_SHOWN = 200  # characters of a bad value an error message quotes (a 10,000-host list is not shown whole)


class ConfigError(Exception):
    """Bad input: a file, variable or option with a value the launcher cannot use.

    The message is one line that names the file or variable and the bad value. The command line
    turns it into exit code 2 before anything is started.
    """


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with the total length named."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
