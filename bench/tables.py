"""The benchmarks' tables: one printer, rich on stdout, labels left and numbers right;
progress lines go to stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterable, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

# stdout that is not a terminal (a log, a pipe) gets this width: the widest table unwrapped
WIDTH = 150


def print_table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    note: str | None = None,
    left: Collection[int] = (0,),
) -> None:
    """``title`` on a line, ``rows`` under ``columns``, then ``note``, all on stdout.

    The columns numbered in ``left`` (labels, text) align left, the others (numbers)
    right. A cell shows ``str`` of its value, ``-`` for None: callers format their
    numbers. Text is printed as it is (no rich markup); the title and note are not wrapped.
    """
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = WIDTH
    table = Table()
    for index, column in enumerate(columns):
        table.add_column(Text(column), justify="left" if index in left else "right")
    for row in rows:
        table.add_row(*(Text("-" if cell is None else str(cell)) for cell in row))
    if title:
        console.print(Text(title), soft_wrap=True)
    console.print(table)
    if note:
        console.print(Text(note), soft_wrap=True)


def progress(prefix: str) -> Callable[[str], None]:
    """A writer of progress lines, ``[prefix] line`` on stderr (stdout keeps the tables)."""
    return lambda line: print(f"[{prefix}] {line}", file=sys.stderr, flush=True)
