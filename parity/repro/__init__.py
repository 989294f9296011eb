"""Minimal, convincing reproductions of upstream bugs: one module per bug, over one shared runner.

:mod:`parity.repro.registry` lists them, :mod:`parity.repro.runner` runs them (and the steps several
share), :mod:`parity.repro.common` holds what they read and write (engines shared across repros, the
result type and its Markdown/JSON), :mod:`parity.repro.standalone` and
:mod:`parity.repro.standalone_src` turn a repro into a self-contained script;
:mod:`parity.repro.standalone_child` runs a child process and reads its traceback, for the repros and
their scripts alike. The command line is :mod:`parity.cli.repro`.
"""
