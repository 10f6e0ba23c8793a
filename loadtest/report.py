"""Every benchmark's report, in one shape: `<name>.json` (everything measured), `<name>.md` (a header — title,
command, date, machine, load before and after, duration — then the tables) and PNG figures (matplotlib when
installed; `bars` and `lines` draw the usual ones). `start` takes the header facts, `write` the files. And
what every benchmark's command line shares (`Parser`: `--out-dir`, `--quick`, typed options) and its progress lines (`logger`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest import machine

Plot = Callable[[Any], Any]  # matplotlib.pyplot → the Figure to save


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, every option's default."""


class Parser(argparse.ArgumentParser):
    """A benchmark's command line: its module docstring as help, `--out-dir` (default reports), with `model` a
    `--model` (the repository's), with `quick_dir` a `--quick`: a smoke run into `quick_dir` with the `quick` values
    of the options left at their defaults (`quick_note`: what else it changes)."""

    def __init__(self, doc: str | None, quick_dir: str = "", quick_note: str = "", model: bool = False, **quick: Any) -> None:
        super().__init__(description=doc, formatter_class=_Help)
        self.quick = {"out_dir": quick_dir, **quick} if quick_dir else {}
        self.add_argument("--out-dir", default="reports", help="where the report goes")
        if model:
            self.add_argument("--model", default="models/smollm2-135m-instruct", help="the model directory")
        if quick_dir:
            changes = [f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in self.quick.items()]
            self.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(changes + ([quick_note] if quick_note else [])))

    def options(self, helps: dict[str, str] | None = None, **defaults: Any) -> None:
        """An option `--name` per keyword, of its default's type (a list: one or more of its items' type); `helps`: their help."""
        for name, default in defaults.items():
            many = isinstance(default, list)
            self.add_argument(f"--{name.replace('_', '-')}", type=type(default[0] if many else default), nargs="+" if many else None,
                              default=default, help=(helps or {}).get(name))

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        opts = super().parse_args(args, namespace)
        for key, value in self.quick.items() if getattr(opts, "quick", False) else ():
            if getattr(opts, key) == self.get_default(key):
                setattr(opts, key, value)
        return opts


def logger(tag: str) -> Callable[[str], None]:
    """A benchmark's progress lines, on stderr: `[tag HH:MM:SS] msg`."""
    return lambda msg: print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start(module: str, device: str = "cpu") -> dict[str, Any]:
    """The header facts, taken before anything runs; `command`: how to run this again from the repository root."""
    return {"command": shlex.join([".venv/bin/python", "-m", f"loadtest.{module}", *sys.argv[1:]]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine.facts(device), "started": time.monotonic()}


def cell(s: dict[str, float] | None, scale: float = 1.0, digits: int = 1) -> str:
    """A spread as `median (min–max)`; the value alone for one repeat; – for none."""
    if not s:
        return "–"
    spread = "" if s["n"] == 1 else f" ({s['min'] * scale:,.{digits}f}–{s['max'] * scale:,.{digits}f})"
    return f"{s['median'] * scale:,.{digits}f}{spread}"


def num(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if value is None else f"{value * scale:,.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Markdown table lines (cells as given, stringified), then a blank line."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def bars(title: str, ylabel: str, groups: dict[str, dict[str, Any]], panels: bool = False) -> Plot:
    """Grouped bars: a group per key of `groups`, a bar per series in it; a spread draws its median with the min–max as
    an error bar, None nothing. `panels`: each group on axes of its own, titled with its key (for different units)."""
    def draw(plt):
        series = list(dict.fromkeys(k for g in groups.values() for k in g))
        parts = [{g: v} for g, v in groups.items()] if panels else [groups]
        size = (4.0 * len(parts), 4.5) if panels else (max(6.0, 1.2 * len(groups) * max(len(series), 1)), 4.5)
        fig, axes = plt.subplots(1, len(parts), figsize=size, squeeze=False)
        width = 0.8 / max(len(series), 1)
        for ax, part in zip(axes[0], parts, strict=True):
            for i, name in enumerate(series):
                values = [part[g].get(name) for g in part]
                med = [(v["median"] if isinstance(v, dict) else v) or 0.0 for v in values]
                err = [[m - v["min"] if isinstance(v, dict) else 0 for m, v in zip(med, values, strict=True)],
                       [v["max"] - m if isinstance(v, dict) else 0 for m, v in zip(med, values, strict=True)]]
                ax.bar([k + i * width for k in range(len(part))], med, width, yerr=err if any(map(any, err)) else None, capsize=4, label=name)
            ax.set_xticks([k + width * (len(series) - 1) / 2 for k in range(len(part))], [] if panels else list(part), fontsize=8)
            ax.set(title=next(iter(part)) if panels else title, ylabel=ylabel)
            ax.legend(fontsize=7)
        if panels:
            fig.suptitle(title)
        return fig

    return draw


def lines(title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]], log: str = "") -> Plot:
    """A line per series through its (x, y) points; `log`: the axes on a log scale ("x", "y", "xy")."""
    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, points in series.items():
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o" if len(points) < 30 else None, label=name)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel, xscale="log" if "x" in log else "linear", yscale="log" if "y" in log else "linear")
        ax.legend(fontsize=7)
        return fig

    return draw


def write(results: dict[str, Any], out_dir: str | Path, name: str, title: str, body: Sequence[str], plots: dict[str, Plot] | None = None) -> list[Path]:
    """Add the load after and the duration to `results` and write the report's files (again, when called
    again: a long benchmark writes after each part); returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results["machine"]["load_avg_after"] = machine.load_average()
    if "started" in results:  # (results made elsewhere, e.g. by a test, carry their own or none)
        results["duration_s"] = round(time.monotonic() - results["started"], 1)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps({k: v for k, v in results.items() if k != "started"}, indent=1, default=str) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plots = None
    for figure, draw in (plots or {}).items():
        fig = draw(plt)
        paths.append(out_dir / f"{figure}.png")
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    head = [f"# {title}", "", f"`{results['command']}`", "",
            f"{results['date']}, {results.get('duration_s')} s; {machine.describe(results['machine'])}.", ""]
    paths[1].write_text("\n".join([*head, *body, "", *(f"![{p.stem}]({p.name})" for p in paths[2:])]).replace("\n\n\n", "\n\n").rstrip() + "\n")
    return paths
