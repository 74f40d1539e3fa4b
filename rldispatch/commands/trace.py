"""Render a field-lineage trace (TRACE.jsonl, one or more files) as an aligned text table.

    python scripts/trace_report.py runs/tiny/trace.jsonl [--step 3] [--stage reward] [--out report.txt]
"""
from __future__ import annotations

import argparse
import sys

from protocol.store.keys import is_prompt_key, parse_trajectory_key, uid_of
from rldispatch.trace import TraceError, read_trace

COLUMNS = (
    ("step", "step"), ("rank", "rank"), ("stage", "stage"), ("field", "field"), ("producer", "producer"),
    ("consumer", "consumer"), ("shape", "shape"), ("lengths", "nested lengths"), ("dtype", "dtype"),
    ("device", "device"), ("valid_len", "valid len"), ("mask_sum", "mask.sum"), ("keys", "uid / keys"),
    ("global_steps", "gs"), ("min_global_steps", "min gs"), ("max_global_steps", "max gs"),
    ("is_padding", "pad"), ("length_ok", "len ok"),
)


def _compact(values):
    """A per-trajectory list shown once when all entries agree, else in full."""
    if values is None:
        return "-"
    if isinstance(values, list):
        if values and all(v == values[0] for v in values):
            return f"{_cell(values[0])} x{len(values)}" if len(values) > 1 else _cell(values[0])
        return "[" + ",".join(_cell(v) for v in values) + "]"
    return _cell(values)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, list):
        return "[" + ",".join(_cell(x) for x in v) + "]"
    return str(v)


def _keys_cell(keys) -> str:
    if not keys:
        return "-"
    uids = sorted({uid_of(k) for k in keys})
    suffixes = ["(prompt)" if is_prompt_key(k) else "{1}_{2}".format(*parse_trajectory_key(k)) for k in keys]
    head = uids[0][:8] + ("+" + str(len(uids) - 1) if len(uids) > 1 else "")
    return f"{head}: " + ",".join(suffixes)


def render(rows: list[dict]) -> str:
    """The rows as an aligned table with one header line; per-trajectory lists are compacted."""
    table = [[title for _, title in COLUMNS]]
    for r in rows:
        line = []
        for key, _ in COLUMNS:
            v = r.get(key)
            if key == "keys":
                line.append(_keys_cell(v))
            elif key in ("lengths", "valid_len", "mask_sum", "global_steps", "min_global_steps", "max_global_steps",
                         "is_padding"):
                line.append(_compact(v))
            else:
                line.append(_cell(v))
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    out = []
    for j, row in enumerate(table):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="+", help="trace JSONL file(s), e.g. one per rank")
    ap.add_argument("--step", type=int, default=None, help="only rows of this step")
    ap.add_argument("--stage", default=None, help="only rows of this stage")
    ap.add_argument("--field", default=None, help="only rows of this field")
    ap.add_argument("--out", default=None, help="write the table here instead of stdout")
    args = ap.parse_args(argv)
    try:
        rows = read_trace(args.trace)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [r for r in rows if (args.step is None or r.get("step") == args.step)
            and (args.stage is None or r.get("stage") == args.stage)
            and (args.field is None or r.get("field") == args.field)]
    if not rows:
        print("error: no trace rows match the filters", file=sys.stderr)
        return 1
    text = render(rows)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {len(rows)} rows to {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
