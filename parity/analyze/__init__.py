"""``parity analyze``: records recorded anywhere, judged by the gates of ``parity run``.

:mod:`~parity.analyze.shards` is the map step (a file, batch by batch, into a mergeable summary; local
processes), :mod:`~parity.analyze.cluster` runs it on Ray or Spark, :mod:`~parity.analyze.report` merges,
judges and writes the report, and :mod:`~parity.analyze.trl` scores a TRL GRPOTrainer capture the same way.
"""

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
