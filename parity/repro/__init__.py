"""Minimal, convincing reproductions of upstream bugs: one module per bug, over one shared runner.

:mod:`parity.repro.registry` lists them, :mod:`parity.repro.common` is the runner (engines shared
across repros, the result type and its Markdown/JSON), :mod:`parity.repro.standalone` and
:mod:`parity.repro.standalone_src` turn a repro into a self-contained script. The command line is
:mod:`parity.cli.repro`.
"""
