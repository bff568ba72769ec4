"""Expand SLURM's compressed host lists (``gpu[01-04,07]``, ``r[1-2]n[1-3]``) as ``scontrol show hostnames`` does.

The forms SLURM writes: names separated by commas at the top level; a name may hold several
bracket groups, each a comma list of numbers and ``low-high`` ranges; the first group varies
slowest (``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1 r2n2``); a range keeps the width of its lower bound
(``n[08-10]`` is ``n08 n09 n10``). Standard library only, no ``scontrol`` needed.
"""

from __future__ import annotations

import itertools
import re

MAX_HOSTS = 100_000  # more nodes than any cluster has: a typo such as n[1-99999999], not a job
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


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


def _numbers(group: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]`` (each range padded to its lower bound's width)."""
    out: list[str] = []
    for item in group.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise HostlistError(f"bad range {item!r} in [{group}]")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise HostlistError(f"range {item!r} runs backwards")
        if len(out) + int(high) - int(low) >= MAX_HOSTS:
            raise HostlistError(f"more than {MAX_HOSTS} hosts")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def _expand_name(name: str) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", name)  # text, group, text, group, ..., text
    choices = [[pieces[i]] if i % 2 == 0 else _numbers(pieces[i]) for i in range(len(pieces))]
    total = 1
    for choice in choices:
        total *= len(choice)
        if total > MAX_HOSTS:
            raise HostlistError(f"more than {MAX_HOSTS} hosts")
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand(text: str) -> list[str]:
    """Every host of a compressed list, in SLURM's order (duplicates kept, as ``scontrol`` keeps them)."""
    hosts: list[str] = []
    for name in split_top_level(text.strip()):
        name = name.strip()
        if not name:
            raise HostlistError("empty host name")
        hosts += _expand_name(name)
        if len(hosts) > MAX_HOSTS:
            raise HostlistError(f"more than {MAX_HOSTS} hosts")
    return hosts
