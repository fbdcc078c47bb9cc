"""The memory footprint report: its rows, totals per layout, and rendering in binary units.

:class:`MemoryReport` (rows of :class:`Row`) is what :func:`dspine.drafter.memory.estimate`
returns and ``dspine memory`` prints (:meth:`MemoryReport.render`) or dumps as JSON
(:meth:`MemoryReport.to_dict`); :func:`fmt_bytes` writes bytes in binary units.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

KiB = 1024
MiB = 1024 ** 2
GiB = 1024 ** 3


def fmt_bytes(n: int | float) -> str:
    """Binary units with up to two decimals: 20480 -> '20 KiB', 2684354560 -> '2.5 GiB'."""
    n = float(n)
    for unit, size in (("TiB", 1024 ** 4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = f"{n / size:.2f}".rstrip("0").rstrip(".")
            return f"{v} {unit}"
    return f"{int(n)} B"


@dataclass
class Row:
    """One line of the report. ``layout``: ``both``, ``release`` or ``dspine``;
    ``scope``: ``shared`` (once per process) or ``request`` (once per request)."""

    key: str
    label: str
    bytes: int
    detail: str = ""
    layout: str = "both"
    scope: str = "shared"
    indent: int = 0
    in_total: bool = True


@dataclass
class MemoryReport:
    """Rows of the footprint plus the settings it was computed for (see :func:`estimate`)."""

    profile: str
    dtype: str
    context: int
    concurrency: int
    window: int
    target: str | None
    rows: list[Row]
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> int:
        for r in self.rows:
            if r.key == key:
                return r.bytes
        raise KeyError(key)

    def total(self, layout: str) -> int:
        """Resident bytes for ``layout`` (``release`` or ``dspine``) at the report's
        context and concurrency (per-request rows times concurrency)."""
        s = 0
        for r in self.rows:
            if r.in_total and r.layout in ("both", layout):
                s += r.bytes * (self.concurrency if r.scope == "request" else 1)
        return s

    def to_dict(self) -> dict:
        return {"profile": self.profile, "dtype": self.dtype, "context": self.context,
                "concurrency": self.concurrency, "window": self.window, "target": self.target,
                "rows": [asdict(r) for r in self.rows],
                "totals": {"release": self.total("release"), "dspine": self.total("dspine")},
                "notes": self.notes}

    def render(self) -> str:
        head = (f"dspine memory: drafter {self.profile}"
                + (f" for target {self.target}" if self.target else "")
                + f", {self.dtype}, context {self.context} positions, concurrency {self.concurrency}")
        lines = [head, ""]
        w = max(len("  " * r.indent + r.label) for r in self.rows) + 2
        for r in self.rows:
            tag = {"release": " [release only]", "dspine": " [dspine only]"}.get(r.layout, "")
            scope = " per request" if r.scope == "request" else ""
            lab = ("  " * r.indent + r.label).ljust(w)
            lines.append(f"{lab}{fmt_bytes(r.bytes):>12}  ({r.bytes:,} B{scope}){tag}"
                         + (f"  {r.detail}" if r.detail else ""))
        lines.append("")
        lines.append(f"{'total, release layout (dense pool, greedy tables)'.ljust(w)}"
                     f"{fmt_bytes(self.total('release')):>12}  ({self.total('release'):,} B)")
        lines.append(f"{'total, dspine runtime (ring buffer, no greedy tables)'.ljust(w)}"
                     f"{fmt_bytes(self.total('dspine')):>12}  ({self.total('dspine'):,} B)")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)
