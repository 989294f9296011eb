"""Minimal, convincing reproductions of upstream bugs: one module per bug, over one shared runner.

registry lists them, runner runs them, common holds results and shared engines, standalone and its
``*_src`` files turn a repro into a self-contained script. The command line is :mod:`parity.cli.repro`.
"""
