"""``parity matrix [FILE]``: show the default scenario matrix, or validate and show a TOML matrix file."""

from __future__ import annotations

import argparse

from parity.core.matrix import default_matrix, load_matrix, pair_coverage


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("matrix", nargs="?", default="default", help="'default' or a TOML matrix file to validate and show")


def main(args: argparse.Namespace) -> int:
    """``parity matrix [FILE]``: list the scenarios and the factor-level pairs they cover."""
    m = default_matrix() if args.matrix == "default" else load_matrix(args.matrix)
    print(f"matrix {m.name}: {len(m.scenarios)} scenarios")
    for s in m.scenarios:
        model = f"  [{s.model}]" if s.model else ""
        print(f"  {s.name:<30} {s.spec.label():<40} prompts={s.prompts} max_tokens={s.max_tokens}{model}")
    print("pair coverage:")
    for k, v in pair_coverage(m).items():
        print(f"  {k}: {', '.join(v)}")
    return 0
