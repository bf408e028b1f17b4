"""``omni plugins list``: every plugin, its status (with the reason when not active) and what it provides.

``--json`` prints a list of objects, one per plugin, with the fields of
:class:`omni_core.plugins.manager.PluginInfo` plus ``model_names`` (pipeline -> the short names that
``Omni(model=...)`` accepts), so a user can find ``shapes`` without reading the plugin's code (schema in
``docs/cli.md``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from omni_core.plugins.types import KINDS

COLUMNS = ("Name", "Version", "Status", "Kinds", "Provides")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plugins", help="list installed plugins and what they provide",
                              description="Inspect Omni plugins.")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    lst = sub.add_parser("list", help="list plugins: name, version, status (with the reason), kinds, components",
                         description="List Omni plugins. Built-in plugins are hidden unless --all is given. "
                                     "Plugins that could not be loaded are always listed, with the reason.")
    lst.add_argument("--json", action="store_true", help="print a JSON list (schema: docs/cli.md)")
    lst.add_argument("--all", action="store_true", help="include the core's built-in plugins")
    lst.add_argument("--kind", choices=sorted(KINDS), metavar="KIND",
                     help=f"only plugins providing this kind of component ({', '.join(KINDS)}); "
                          "plugins that failed to load are kept, since what they provide is unknown")
    lst.set_defaults(func=run_list)
    p.set_defaults(func=run_list, json=False, all=False, kind=None)  # `omni plugins` = `omni plugins list`


def plugin_rows(pm=None, *, include_builtin: bool = False, kind: str | None = None) -> list[dict[str, Any]]:
    """The ``--json`` payload: one dict per plugin (fields as in ``PluginInfo``), built-ins first, then by name."""
    from omni_core.plugins.manager import ACTIVE, get_plugin_manager

    pm = pm or get_plugin_manager()
    infos = sorted(pm.list_plugins(include_builtin=include_builtin), key=lambda i: (not i.builtin, i.name))
    pipelines = pm.components("pipeline")
    rows = []
    for info in infos:
        row = info.to_dict()
        mine = [pipelines[n] for n in row["components"].get("pipeline", []) if n in pipelines]
        row["model_names"] = {s.name: list(s.model_names) for s in mine if s.provider == info.dist and s.model_names}
        rows.append(row)
    if kind is not None:
        rows = [r for r in rows if kind in r["kinds"] or r["status"] != ACTIVE]
    return rows


def _provides(row: dict[str, Any]) -> str:
    comps = {kind: [_with_models(row, kind, n) for n in names] for kind, names in row["components"].items()}
    if not comps:
        return "-"
    if len(comps) == 1:
        return ", ".join(next(iter(comps.values())))
    return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in comps.items())


def _with_models(row: dict[str, Any], kind: str, name: str) -> str:
    """A pipeline with short model names shows them: ``ShapesPipeline (model=shapes)``."""
    names = row["model_names"].get(name) if kind == "pipeline" else None
    return f"{name} (model={' | '.join(names)})" if names else name


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table; a plugin that is not active gets its reason on the line below."""
    table = [COLUMNS] + [(r["name"], r["version"] or "-", r["status"], ", ".join(r["kinds"]) or "-", _provides(r))
                         for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS) - 1)]
    out = []
    for line, row in zip(table, [None, *rows]):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1])
        if row is not None and row["error"]:
            out.append(f"    reason: {row['error']}")
    return "\n".join(s.rstrip() for s in out)


def run_list(args: argparse.Namespace) -> int:
    rows = plugin_rows(include_builtin=args.all, kind=args.kind)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no plugins installed" + ("" if args.all else " (built-in plugins are hidden; --all shows them)"))
        return 0
    print(format_table(rows))
    if any("pipeline" in r["kinds"] for r in rows):
        from omni_core.cli.coverage import summary_line
        from omni_core.plugins.manager import get_plugin_manager

        print("\nmodel= takes a name shown as (model=...), or a diffusers folder whose model_index.json names a "
              "pipeline")
        line = summary_line(get_plugin_manager())
        if line:
            print(line)
    if not args.all:
        print("\n(built-in plugins are hidden; --all shows them)")
    return 0
