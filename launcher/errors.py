"""The one exception the launcher raises for bad input."""


class ConfigError(Exception):
    """Bad input: a file, variable or option with a value the launcher cannot use.

    The message is one line that names the file or variable and the bad value. The command line
    turns it into exit code 2 before anything is started.
    """
