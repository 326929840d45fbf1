"""Figures from measurements: per-scenario rows, the terminal table, the targets, the
JSON file, the Markdown table, the plot, and the HTML report (all of it, plot embedded)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path

import numpy as np

from shardfeed.benchmarks.scenarios import Measurement
from shardfeed.sizes import format_size

BASELINE = "individual-gets"
SCENARIOS = {
    "individual-gets": "one boto3 GET per sample (one object per sample): the baseline",
    "direct-ranged": "ranged GETs into the shards via the index, no service",
    "shardfeed-cold": "POST /v1/batch through the client, first epoch on an empty cache",
    "shardfeed-warm": "POST /v1/batch through the client, second epoch (cache warm)",
    "per-sample": "per-sample GETs from many concurrent requesters, empty cache (coalesced)",
    "dataloader": "PyTorch DataLoader epoch over ShardfeedDataset, cache warm",
    "minimal-http": "bare uvicorn app returning a prebuilt batch body: the HTTP limit",
}
"""Every scenario a run reports, with the one-line meaning printed under the table."""


def _ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if len(values) else None


def row(scenario: str, latency_ms: float, size: int, batch: int | None, m: Measurement) -> dict:
    """One result row: the scenario's figures under one (S3 latency, sample size, batch size)."""
    seconds = max(m.seconds, 1e-9)
    return {
        "scenario": scenario,
        "s3_latency_ms": latency_ms,
        "sample_size": size,
        "batch_size": batch,
        "samples": m.samples,
        "seconds": round(m.seconds, 4),
        "samples_per_s": round(m.samples / seconds, 1),
        "mb_per_s": round(m.nbytes / seconds / 1e6, 2),
        "batch_p50_ms": _ms(m.batch_latencies, 50),
        "batch_p95_ms": _ms(m.batch_latencies, 95),
        "batch_p99_ms": _ms(m.batch_latencies, 99),
        "sample_p50_ms": _ms(m.sample_latencies, 50),
        "sample_p99_ms": _ms(m.sample_latencies, 99),
        "s3_requests": m.s3_requests,
        "s3_requests_per_1000": None if m.s3_requests is None else round(1000 * m.s3_requests / m.samples, 2),
        "s3_bytes_per_byte": None if m.s3_bytes is None else round(m.s3_bytes / m.nbytes, 3),
        "ratio": None,
    }


def add_ratios(rows: list[dict], headline: dict[int, int]) -> None:
    """``ratio``: samples/s over the individual-GET baseline of the same latency, size and
    batch (for per-sample GETs, which have no batch: the baseline at ``headline[size]``)."""
    base = {(r["s3_latency_ms"], r["sample_size"], r["batch_size"]): r["samples_per_s"]
            for r in rows if r["scenario"] == BASELINE}
    for r in rows:
        batch = r["batch_size"] if r["batch_size"] is not None else headline.get(r["sample_size"])
        rate = base.get((r["s3_latency_ms"], r["sample_size"], batch))
        r["ratio"] = round(r["samples_per_s"] / rate, 2) if rate else None


def find(rows: Iterable[dict], scenario: str, latency: float, size: int, batch: int | None) -> dict | None:
    for r in rows:
        if (r["scenario"], r["s3_latency_ms"], r["sample_size"], r["batch_size"]) == (scenario, latency, size, batch):
            return r
    return None


def targets(rows: list[dict], latencies: Sequence[float], headline: dict[int, int]) -> list[dict]:
    """The goals of issues 5 and 11, checked against this run (``met`` is None where not measured)."""
    out = []

    def goal(name: str, latency: float, scenario: str, value: float | None, want: str, bound: float) -> None:
        met = None if value is None else (value >= bound if want == ">=" else value <= bound)
        out.append({"target": name, "s3_latency_ms": latency, "scenario": scenario,
                    "value": None if value is None else round(value, 2), "goal": f"{want} {bound:g}", "met": met})

    kib10, mib1 = 10 << 10, 1 << 20
    for latency in latencies:
        base = find(rows, BASELINE, latency, kib10, 256)
        minimal = find(rows, "minimal-http", latency, kib10, 256)
        for scenario in ("shardfeed-cold", "shardfeed-warm"):
            r = find(rows, scenario, latency, kib10, 256)
            goal("10 KiB, batch 256: throughput vs individual GETs (aim 25x)", latency, scenario,
                 r and r["ratio"], ">=", 15)
            p99 = base and r and r["sample_p99_ms"] and base["sample_p99_ms"] / r["sample_p99_ms"]
            goal("10 KiB, batch 256: P99 per-sample latency, individual / shardfeed", latency, scenario,
                 p99 or None, ">=", 3.7)
            big = find(rows, scenario, latency, mib1, headline.get(mib1))
            goal(f"1 MiB, batch {headline.get(mib1, '-')}: throughput vs individual GETs", latency, scenario,
                 big and big["ratio"], ">=", 1.7)
        warm = find(rows, "shardfeed-warm", latency, kib10, 256)
        goal("10 KiB, batch 256: minimal HTTP rate / warm shardfeed rate", latency, "shardfeed-warm",
             minimal and warm and minimal["samples_per_s"] / warm["samples_per_s"], "<=", 2)
        if latency == 20:  # issue 11: on a real S3 server, with a cloud-like time to first byte
            cold = find(rows, "shardfeed-cold", latency, kib10, 256)
            goal("10 KiB, batch 256, cold cache: throughput vs individual GETs (issue 11)", latency,
                 "shardfeed-cold", cold and cold["ratio"], ">=", 25)
    return out


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


COLUMNS = [
    ("S3 +ms", 6), ("size", 7), ("batch", 5), ("scenario", 15), ("samples/s", 10), ("MB/s", 8),
    ("batch p50", 9), ("p95", 8), ("p99", 8), ("sample p50", 10), ("p99", 8), ("S3 req/1k", 9),
    ("S3 B/B", 7), ("ratio", 7),
]


def cells(r: dict) -> list[str]:
    return [
        _num(r["s3_latency_ms"], "g"), format_size(r["sample_size"]), _num(r["batch_size"], "d"), r["scenario"],
        _num(r["samples_per_s"], ",.0f"), _num(r["mb_per_s"], ".1f"),
        _num(r["batch_p50_ms"], ".1f"), _num(r["batch_p95_ms"], ".1f"), _num(r["batch_p99_ms"], ".1f"),
        _num(r["sample_p50_ms"], ".2f"), _num(r["sample_p99_ms"], ".1f"),
        _num(r["s3_requests_per_1000"], ".1f"), _num(r["s3_bytes_per_byte"], ".2f"),
        "-" if r["ratio"] is None else f"{r['ratio']:.1f}x",
    ]


def table(rows: list[dict]) -> str:
    """The fixed-width terminal table (latencies in ms)."""
    lines = ["  ".join(name.rjust(width) for name, width in COLUMNS)]
    for r in rows:
        lines.append("  ".join(cell.rjust(width) for cell, (_, width) in zip(cells(r), COLUMNS)))
    return "\n".join(lines)


def _about(machine: dict, config: dict) -> tuple[str, str]:
    """The machine and the settings of a run, one sentence each."""
    return (f"Machine: {machine['cpu']} ({machine['cores']} cores), {machine['memory_gib']} GiB RAM, "
            f"{machine['platform']}, Python {machine['python']}; load average {machine['load_before']} "
            f"before, {machine['load_after']} after. Run took {config['elapsed_s']:.0f} s.",
            f"Settings: {config['workers']} requests in flight per scenario ({config['requesters']} "
            f"requesters for per-sample GETs), shards of {format_size(config['shard_size'])}, cache "
            f"blocks of {format_size(config['block_size'])}, S3 = {config['s3']}.")


TARGET_COLUMNS = ("target", "S3 +ms", "scenario", "value", "goal", "met")
ALL_SCENARIOS_NOTE = ("Latencies in ms; MB = 10^6 bytes; ratio = samples/s over individual GETs at the same "
                      "S3 latency, size and batch.")


def _target_cells(g: dict, no: str) -> list[str]:
    met = {True: "yes", False: no, None: "not measured"}[g["met"]]
    return [g["target"], format(g["s3_latency_ms"], "g"), g["scenario"], _num(g["value"], ".2f"), g["goal"], met]


def markdown(rows: list[dict], machine: dict, config: dict, goals: list[dict]) -> str:
    """``results.md``: the machine, the settings, the targets and the full table."""
    out = ["# shardfeed bench results", "", *(line for text in _about(machine, config) for line in (text, "")),
           "## Targets", "", "| " + " | ".join(TARGET_COLUMNS) + " |", "|" + "---|" * len(TARGET_COLUMNS)]
    out += ["| " + " | ".join(_target_cells(g, "**no**")) + " |" for g in goals]
    out += ["", "## All scenarios", "", ALL_SCENARIOS_NOTE, "",
            "| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    out += ["", "## Scenarios", ""] + [f"- `{name}`: {text}" for name, text in SCENARIOS.items()]
    return "\n".join(out) + "\n"


def html(rows: list[dict], machine: dict, config: dict, goals: list[dict], plot_png: bytes) -> str:
    """``results.html``: what ``results.md`` says, with the plot embedded: one file to open."""
    def table(headers, body_rows, numeric_from: int) -> str:
        head = "".join(f"<th>{escape(h)}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f'<td{" class=n" if i >= numeric_from else ""}>{escape(c)}</td>'
                                        for i, c in enumerate(r)) + "</tr>" for r in body_rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    machine_text, settings_text = _about(machine, config)
    image = base64.b64encode(plot_png).decode()
    scenarios = "".join(f"<li><code>{escape(name)}</code>: {escape(text)}</li>" for name, text in SCENARIOS.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shardfeed bench results</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 20px; color: #1d2430; max-width: 1400px; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; font-variant-numeric: tabular-nums; }}
th, td {{ border-bottom: 1px solid #d9dee6; padding: 3px 8px; text-align: left; }}
td.n {{ text-align: right; }} th {{ color: #5d6778; font-weight: 500; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>shardfeed bench results</h1>
<p>{escape(machine_text)}</p>
<p>{escape(settings_text)}</p>
<img alt="throughput over one GET per sample, by sample size" src="data:image/png;base64,{image}">
<h2>Targets</h2>
{table(TARGET_COLUMNS, [_target_cells(g, "NO") for g in goals], 3)}
<h2>All scenarios</h2>
<p>{escape(ALL_SCENARIOS_NOTE)}</p>
{table([name for name, _ in COLUMNS], [cells(r) for r in rows], 4)}
<h2>Scenarios</h2>
<ul>{scenarios}</ul>
</body></html>
"""


def write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=1) + "\n")


def plot(path: Path, rows: list[dict], latencies: Sequence[float], headline: dict[int, int]) -> None:
    """Throughput ratio over individual GETs vs sample size, one line per scenario and one
    panel per S3 latency, at each size's headline batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(headline)
    fig, axes = plt.subplots(1, len(latencies), figsize=(6 * len(latencies), 4.5), squeeze=False, sharey=True)
    for ax, latency in zip(axes[0], latencies):
        for scenario in SCENARIOS:
            if scenario == BASELINE:
                continue
            points = [(s, r["ratio"]) for s in sizes
                      if (r := find(rows, scenario, latency, s, None if scenario == "per-sample" else headline[s]))
                      and r["ratio"]]
            if points:
                style = "--" if scenario == "minimal-http" else "-"
                ax.plot(*zip(*points), style, marker="o", label=scenario)
        ax.axhline(1, color="grey", linewidth=1, linestyle=":", label="individual GETs")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [format_size(s) for s in sizes])
        ax.set_xlabel("sample size (batch: " + ", ".join(f"{headline[s]}" for s in sizes) + ")")
        ax.set_title(f"S3 latency +{latency:g} ms")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("throughput / individual GETs")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
