"""The run's report: report.json and its schema (:mod:`~parity.report.schema`), report.md
(:mod:`~parity.report.markdown`) and the PNG plots (:mod:`~parity.report.plots`)."""
