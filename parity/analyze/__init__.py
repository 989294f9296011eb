"""``parity analyze``: records recorded anywhere, judged by the gates of ``parity run``.

:mod:`~parity.analyze.shards`: the map step; :mod:`~parity.analyze.cluster`: it on Ray;
:mod:`~parity.analyze.report`: merge, judge, report; :mod:`~parity.analyze.trl`: a TRL capture (docs/records.md)."""

from parity.analyze.report import analyze
from parity.analyze.shards import summarize_paths

__all__ = ["analyze", "summarize_paths"]
