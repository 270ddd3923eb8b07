"""What every bench command shares at its edges: the vLLM check with its install hint, the
table renderer (rich if installed, sized to the terminal), the plot backend, and setting the
plugin's environment controls around a scheduler's construction.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybrid_alloc.vllm.releases import ENGINE_RELEASE, SUPPORTED_RELEASES, vllm_requirement

INSTALL_HINT = (
    f"vLLM is not installed: pip install '{vllm_requirement()}' (one of {', '.join(SUPPORTED_RELEASES)}), "
    f"or run `bash scripts/bench.sh` (vLLM {ENGINE_RELEASE}'s CPU build)"
)
# The package is not on PyPI: the `bench` extra installs from a checkout of this repository.
PLOT_SKIPPED = (
    "plot skipped: matplotlib is not installed (pip install matplotlib, or from this repository's checkout: "
    "pip install '.[bench]')"
)


def vllm_ready() -> bool:
    """Whether vLLM imports (else prints the install hint); quiets vLLM's logger for the run.
    The common start of ``hybrid-alloc bench`` and ``hybrid-alloc hits``."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return False
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    return True


@contextmanager
def env_set(values: dict[str, str | None]) -> Iterator[None]:
    """The environment with ``values`` set (None: unset) while the block runs, then as it was:
    how a bench builds a scheduler under the plugin's environment controls."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pyplot() -> Any | None:
    """matplotlib's ``pyplot`` on the Agg backend, or ``None`` after one line on stderr when
    matplotlib is not installed: the plot is the only output that needs it, so the run (its
    table and JSON) goes on without it. Shared by ``hybrid-alloc bench`` and ``hits``."""
    try:
        import matplotlib
    except ImportError:
        print(PLOT_SKIPPED, file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: Columns of a table: (row key, heading, format).
Columns = list[tuple[str, str, str]]


def terminal_width() -> int:
    """The width the default tables fit: ``COLUMNS`` if set, else the terminal's, else 80
    (output to a file or a pipe)."""
    return shutil.get_terminal_size((80, 24)).columns


def say(text: str, wide: bool = False, indent: str = "") -> None:
    """Prints ``text`` wrapped to :func:`terminal_width` (continuation lines indented by two
    more spaces); as one line with ``wide`` (``--wide``)."""
    if wide:
        print(indent + text)
        return
    print(
        textwrap.fill(
            text,
            width=max(terminal_width(), 40),
            initial_indent=indent,
            subsequent_indent=indent + "  ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    )


def say_parts(head: str, parts: list[str], sep: str, wide: bool = False, indent: str = "") -> None:
    """Prints ``head`` then ``parts`` joined by ``sep``, wrapped to :func:`terminal_width` only
    between parts (a part is never split; a line that breaks ends with ``sep``'s mark, the next is
    indented by four more spaces); as
    one line with ``wide``."""
    line = indent + head + sep.join(parts)
    if wide or not parts:
        print(line)
        return
    width = max(terminal_width(), 40)
    lines = []
    line = indent + head.rstrip()
    for i, part in enumerate(parts):
        glue = " " if i == 0 else sep
        mark = 0 if i == len(parts) - 1 else len(sep.rstrip())  # room for the mark if the line breaks after it
        if len(line) + len(glue) + len(part) + mark <= width:
            line += glue + part
        else:
            lines.append(line + (sep.rstrip() if i > 0 else ""))
            line = indent + "    " + part
    lines.append(line)
    print("\n".join(lines))


def render_table(
    title: str, cols: Columns, rows: list[dict[str, Any]], caption: str | None = None, wide: bool = False
) -> None:
    """One table: ``cols`` are (row key, heading, format); with rich if it is installed, else as
    plain text. The title and caption are printed as lines of their own (wrapped to the
    terminal). By default the table fits :func:`terminal_width` (the callers pass few, short
    columns; rich wraps a cell only if the terminal is narrower still); with ``wide``
    (``--wide``) it takes its natural width, however wide."""
    say(title, wide)
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(" | ".join(h for _, h, _ in cols))
        for r in rows:
            print(" | ".join(fmt.format(r[k]) if k in r else "" for k, _, fmt in cols))
    else:
        # One space between columns, a rule under the headings; text columns to the left,
        # numbers to the right; a cell too wide for a narrow terminal folds, never truncated.
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))
        for key, head, _ in cols:
            text = all(isinstance(r.get(key, ""), str) for r in rows)
            t.add_column(head, justify="left" if text else "right", overflow="fold")
        for r in rows:
            t.add_row(*[fmt.format(r[k]) if k in r else "" for k, _, fmt in cols])
        Console(width=100_000 if wide else terminal_width()).print(t)
    if caption is not None:
        say(caption, wide)
