"""Expand SLURM's compressed host lists (``gpu[01-04,07]``, ``r[1-2]n[1-3]``) as ``scontrol show hostnames`` does.

The forms SLURM writes: names separated by commas at the top level; a name may hold several
bracket groups, each a comma list of numbers and ``low-high`` ranges; the first group varies
slowest (``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1 r2n2``); a range keeps the width of its lower bound
(``n[08-10]`` is ``n08 n09 n10``). Standard library only, no ``scontrol`` needed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from launcher.errors import MAX_DIGITS, digits_value

MAX_HOSTS = 100_000  # more nodes than any cluster has: a typo such as n[1-99999999], not a job
_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")


class HostlistError(ValueError):
    """A host list that is not in SLURM's syntax (the message says what is wrong)."""


def split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"']' without '[' at position {i}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _ranges(group: str) -> list[tuple[int, int, int]]:
    """``01-03,7`` -> ``[(1, 3, 2), (7, 7, 1)]``: (low, high, width of the lower bound); nothing expanded."""
    out: list[tuple[int, int, int]] = []
    for item in group.split(","):
        match = _RANGE.match(item.strip())
        low = digits_value(match.group(1)) if match else None
        high = digits_value(match.group(2) or match.group(1)) if match else None
        if low is None or high is None:
            raise HostlistError(f"bad range {item[:40]!r} in a bracket group (at most {MAX_DIGITS} digits)")
        if high < low:
            raise HostlistError(f"range {item!r} runs backwards")
        out.append((low, high, len(match.group(1).strip())))  # type: ignore[union-attr]
    return out


def _pieces(name: str) -> list[object]:
    """Text and bracket groups, alternately: ``r[1-2]n`` -> ``["r", [(1, 2, 1)], "n"]``."""
    pieces = re.split(r"\[([^\]]*)\]", name)  # text, group, text, group, ..., text
    return [piece if i % 2 == 0 else _ranges(piece) for i, piece in enumerate(pieces)]


def _count(pieces: list[object], room: int) -> int:
    """How many hosts a name stands for; past ``room`` the count stops (it is refused anyway)."""
    total = 1
    for piece in pieces:
        if isinstance(piece, list):
            total *= sum(high - low + 1 for low, high, _ in piece)
            if total > room:
                raise HostlistError(f"more than {MAX_HOSTS} hosts")
    return total


def _expand_name(pieces: list[object]) -> Iterator[str]:
    choices = [[piece] if isinstance(piece, str) else
               [str(n).zfill(width) for low, high, width in piece for n in range(low, high + 1)]
               for piece in pieces]
    return ("".join(parts) for parts in itertools.product(*choices))


def expand(text: str) -> list[str]:
    """Every host of a compressed list, in SLURM's order (duplicates kept, as ``scontrol`` keeps them).

    The hosts are counted before any is made, so memory is bounded by :data:`MAX_HOSTS`, whatever
    the number of names and bracket groups.
    """
    names, total = [], 0
    for name in split_top_level(text.strip()):
        name = name.strip()
        if not name:
            raise HostlistError("empty host name")
        pieces = _pieces(name)
        total += _count(pieces, MAX_HOSTS - total)
        names.append(pieces)
    return [host for pieces in names for host in _expand_name(pieces)]
