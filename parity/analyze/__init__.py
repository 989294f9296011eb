"""``parity analyze``: records recorded anywhere, judged by the gates of ``parity run``.

:mod:`~parity.analyze.shards`: the map step; :mod:`~parity.analyze.cluster`: it on Ray;
:mod:`~parity.analyze.report`: merge, judge, report; :mod:`~parity.analyze.trl`: a TRL capture (docs/records.md)."""

from parity.analyze.report import REPORT_FACTS, analyze, build_report, set_verdict
from parity.analyze.shards import (
           batch_summarizer,
           file_header,
           rescored_columns,
           summarize_file,
           summarize_paths,
)

__all__ = ["REPORT_FACTS", "analyze", "batch_summarizer", "build_report", "file_header", "rescored_columns",
           "set_verdict", "summarize_file", "summarize_paths"]
