"""Minimal, convincing reproductions of upstream bugs: one module per bug, over one shared runner.

:mod:`parity.repro.registry` lists them, :mod:`parity.repro.runner` runs them (and the steps several
share), :mod:`parity.repro.common` holds what they read and write (engines shared across repros, the
result type and its Markdown/JSON), :mod:`parity.repro.standalone` and
:mod:`parity.repro.standalone_src` turn a repro into a self-contained script. The command line is
:mod:`parity.cli.repro`.
"""
