"""`python -m training.report [--plot [PNG]] RUN_DIR`: the goodput report of a run (`goodput`) printed and
written to RUN_DIR/report.json, and its timeline picture (`plot`) when asked."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from training.contract.files import replace_file
from training.report import goodput
from training.report.goodput import ReportError, format_report, report_run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.report", description=goodput.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="run directory holding events/*.jsonl")
    parser.add_argument("--plot", nargs="?", const="", metavar="PNG",
                        help="draw the timeline (default RUN_DIR/timeline.png)")
    args = parser.parse_args(argv)
    try:
        print(write_report(args.run_dir, plot=args.plot is not None,
                           png=Path(args.plot) if args.plot else None))
    except (ReportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def write_report(run_dir: Path, plot: bool, png: Path | None = None) -> str:
    """Report a run: RUN_DIR/report.json, and the timeline picture when asked; returns the text."""
    timeline, report = report_run(run_dir)
    json_path = run_dir / "report.json"
    replace_file(json_path, (report.to_json() + "\n").encode())
    lines = [f"wrote {json_path}"]
    if plot:
        from training.report.plot import plot_timeline  # matplotlib only when a picture is asked for

        lines.append(f"wrote {plot_timeline(timeline, report, png or run_dir / 'timeline.png')}")
    # the report last: its last lines say what the faults cost
    return "\n".join([*lines, format_report(report)])
