"""What the small CPU benchmarks share: interleaved timing, their header (versions, CPU model and ISA) and their
results files."""

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

import fastmha
from fastmha.info import cpu_lines


def interleaved_ms(calls, repeats):
    """Median milliseconds of each of calls {name: fn}: one warm-up call each, then repeats rounds that call every
    one in turn (so drift hits them alike)."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def machine_header():
    """Lines saying what ran: fastmha, torch, threads, date, CPU model and ISA (printed and written with results)."""
    return [f"fastmha {fastmha.__version__} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
            f"{datetime.date.today()}", *cpu_lines()]


def markdown(title, header, setup, columns, rows):
    """A results page: title, the machine header, the setup sentence, and a table of columns {name: cell(row)}."""
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(str(cell(r)) for cell in columns.values()) + " |" for r in rows]
    return "\n".join([title, "", *[f"- {line}" for line in header], "", setup, "", *table]) + "\n"


def results_file(out, suffix):
    """OUT + suffix. Not with_suffix: a name such as "...-dropout-0.1-DATE" keeps its dots."""
    return out.with_name(out.name + suffix)


def write_results(out, header, rows, page):
    """OUT.json (machine header and rows) and OUT.md (the page)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    results_file(out, ".json").write_text(json.dumps({"machine": header, "rows": rows}, indent=1) + "\n")
    results_file(out, ".md").write_text(page)


def start(doc, default_repeats, add_arguments=None):
    """The command line of a small benchmark (--out, --repeats, --quick, and what add_arguments(parser) adds) and
    its start: returns (args, repeats: 1 for --quick, the machine header, printed)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    parser.add_argument("--repeats", type=int, default=default_repeats)
    parser.add_argument("--quick", action="store_true")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    header = machine_header()
    print("\n".join(header), flush=True)
    return args, 1 if args.quick else args.repeats, header
