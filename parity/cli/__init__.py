"""The ``parity`` command line: :mod:`parity.cli.main` builds the parser; one module per command."""
