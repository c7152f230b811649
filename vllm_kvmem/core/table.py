"""The one text-table renderer: ``kvmem plan``, the startup report, the demo."""

from __future__ import annotations

from collections.abc import Sequence

#: A header that makes its column a rule: every row shows ``|`` there, and
#: the rows leave it out of their cells.
BAR = "|"


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    widths: Sequence[int] = (),
    left: int = 1,
    sep: str = "  ",
    indent: str = "",
) -> list[str]:
    """A header line and one line per row, columns padded to their widest cell.

    The first ``left`` columns are left-aligned, the others right-aligned;
    ``widths`` are minimum widths, so columns keep their place while the
    figures are short. Lines carry no trailing spaces.
    """
    bars = [i for i, h in enumerate(headers) if h == BAR]
    cells = [list(map(str, headers))]
    for row in rows:
        cells.append([str(c) for c in row])
        for i in bars:
            cells[-1].insert(i, BAR)
    width = [
        max([*(len(r[i]) for r in cells), widths[i] if i < len(widths) else 0])
        for i in range(len(headers))
    ]
    return [
        (
            indent
            + sep.join(
                c.ljust(width[i]) if i < left else c.rjust(width[i])
                for i, c in enumerate(r)
            )
        ).rstrip()
        for r in cells
    ]
