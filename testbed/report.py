"""``testbed report``: figures (PNG), one self-contained HTML page and CSV tables from
results folders (``run``'s results.json, or a sweep folder with sweep.json).

Figures (matplotlib, no pyplot state, so it works in threads and without a display):

* ``cct.png`` — CCT per variant: mean bar, min..max spread, every repetition, the cost
  model's prediction and the strict bound (the optimal tree packing's transfer time) beside it, efficiency = bound/CCT;
* ``gantt-N.png`` — one measured iteration of the main scheme: every transfer as a bar on
  its (sender -> receiver) row while it is being received (a thin line while sent but not
  yet arriving), coloured by flow (tree);
* ``links-N.png`` — goodput of every WAN link direction over the run against its
  configured rate (which ``dynamics`` change), with dynamics and faults marked.  Transfers
  between non-adjacent datacenters are charged to every link of their routed path
  (:func:`testbed.routing.data_paths`, the emulator's routes); bytes are spread evenly over
  a transfer's receive start .. end (application-level: a receiver draining its socket
  buffer shows short peaks above the rate); light lines: where each variant's run starts;
* ``rounds-N.png`` — groups runs (CREW at run time, no iterations): rounds each worker
  completed in the window T, one bar per variant (mean over repetitions, min..max spread);
* ``sweep.png`` — for sweeps: the first swept parameter on x, mean CCT on y, one line per
  scheme (and per value of the other swept parameters).
"""

from __future__ import annotations

import base64
import csv
import html
import json
import math
from pathlib import Path

import networkx as nx

from testbed.results import TCP_FIELDS

FIG_W_IN, DPI = 10.0, 100  # every figure is 1000 px wide
MAX_LINK_PANELS = 24


class ReportError(Exception):
    pass


# -- loading -------------------------------------------------------------------------
def load(folder: Path) -> dict:
    """``{"kind": "run"|"sweep", "dir", "results"|"sweep"}`` for a results folder."""
    folder = Path(folder)
    from testbed.errors import ConfigError

    for name, kind in (("sweep.json", "sweep"), ("results.json", "run")):
        p = folder / name
        if p.exists():
            try:
                return {"kind": kind, "dir": folder, kind if kind == "sweep" else "results": json.loads(p.read_text())}
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot read {name}: {e}", source=str(p)) from None
    raise ConfigError("no results.json or sweep.json here", source=str(folder))


# -- tables ----------------------------------------------------------------------------
VARIANT_COLUMNS = ["experiment", "variant", "scheme", "repetitions", "cct_mean_s", "cct_min_s", "cct_max_s",
                   "cct_stdev_s", "predicted_cct_s", "bound_s", "estimate_cct_s", "efficiency", "rounds_total_mean", "correct",
                   "error"]


def variant_rows(results: dict) -> list[dict]:
    """One row per variant of a results.json (the comparison table)."""
    rows = []
    for v in results.get("variants", []):
        s, c = v["summary"], v["summary"]["cct_s"]
        rows.append({"experiment": results["experiment"]["name"], "variant": v["label"], "scheme": v["scheme"]["name"],
                     "repetitions": c.get("n"), "cct_mean_s": c.get("mean"), "cct_min_s": c.get("min"),
                     "cct_max_s": c.get("max"), "cct_stdev_s": c.get("stdev"),
                     "predicted_cct_s": s.get("predicted_cct_s"), "bound_s": s.get("bound_s"),
                     "estimate_cct_s": s.get("estimate_cct_s"),
                     "efficiency": s.get("efficiency"), "rounds_total_mean": (s.get("rounds_total") or {}).get("mean"),
                     "correct": s.get("correct"), "error": v.get("error")})
    return rows


LINK_COLUMNS = ["experiment", "variant", "repetition", "src", "dst", "bytes", "transfers", "span_s", "goodput_mbps",
                *TCP_FIELDS]


def link_rows(results: dict) -> list[dict]:
    return [{"experiment": results["experiment"]["name"], "variant": r["variant"], "repetition": r["repetition"],
             **{k: lk.get(k, "") for k in LINK_COLUMNS[3:]}}
            for r in results.get("runs", []) for lk in r.get("links", [])]


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


# -- figures ---------------------------------------------------------------------------
def _figure(height_in: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(FIG_W_IN, max(2.5, height_in)), dpi=DPI, layout="constrained")


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png")
    return path


def cct_figure(entries: list[tuple[str, dict]], path: Path) -> Path:
    """``entries``: (label, variant record with ``summary``) plus its runs under ``_runs``."""
    fig = _figure(1.2 + 0.35 * len(entries) if len(entries) > 12 else 4.5)
    ax = fig.add_subplot()
    xs = range(len(entries))
    means = [e["summary"]["cct_s"]["mean"] or 0.0 for _, e in entries]
    ax.bar(xs, means, width=0.6, color="#8fb3d9", label="CCT (mean)")
    ax.set_xlim(-0.6 - 0.5 * (len(entries) < 4), len(entries) - 0.4 + 0.5 * (len(entries) < 4))
    lo = [m - (e["summary"]["cct_s"]["min"] or m) for m, (_, e) in zip(means, entries)]
    hi = [(e["summary"]["cct_s"]["max"] or m) - m for m, (_, e) in zip(means, entries)]
    ax.errorbar(xs, means, yerr=[lo, hi], fmt="none", ecolor="black", capsize=4, label="min .. max")
    for x, (_, e) in zip(xs, entries):
        reps = [r["cct_s"] for r in e.get("_runs", []) if r.get("cct_s") is not None]
        ax.plot([x] * len(reps), reps, "o", color="#1f4e79", ms=3, zorder=3)
    pred = [(x, e["summary"].get("predicted_cct_s")) for x, (_, e) in zip(xs, entries)]
    bound = [(x, e["summary"].get("bound_s")) for x, (_, e) in zip(xs, entries)]
    ax.plot([x for x, p in pred if p is not None], [p for _, p in pred if p is not None], "D", color="#d95f02",
            label="predicted")
    ax.plot([x for x, b in bound if b is not None], [b for _, b in bound if b is not None], "_", color="#1b9e77",
            ms=22, mew=3, label="bound (strict: optimal packing's transfer time)")
    for x, m, (_, e) in zip(xs, means, entries):
        eff = e["summary"].get("efficiency")
        if eff is not None:
            ax.annotate(f"eff {eff:.2f}", (x, m), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xticks(list(xs), [lbl for lbl, _ in entries], rotation=30 if len(entries) > 4 else 0, ha="right"
                  if len(entries) > 4 else "center")
    ax.set_ylabel("CCT (s)")
    ax.margins(y=0.1)
    ax.set_title("Collective completion time per variant (efficiency = bound / measured)")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def rounds_figure(results: dict, path: Path) -> Path | None:
    """Groups runs: rounds each worker completed in the window T, grouped bars per worker,
    one colour per variant (mean over its repetitions, min..max whiskers); None if the
    results hold no groups run."""
    runs = [r for r in results.get("runs", []) if r.get("rounds")]
    if not runs:
        return None
    labels = list(dict.fromkeys(r["variant"] for r in runs))
    nodes = list(dict.fromkeys(n for r in runs for n in r["rounds"]))
    fig = _figure(4.5)
    ax = fig.add_subplot()
    width = 0.8 / len(labels)
    for i, lbl in enumerate(labels):
        per = [[r["rounds"].get(n, 0) for r in runs if r["variant"] == lbl] for n in nodes]
        mean = [sum(v) / len(v) for v in per]
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(nodes))]
        total = sum(mean)
        ax.bar(xs, mean, width=width * 0.9, label=f"{lbl} (total {total:.3g})")
        ax.errorbar(xs, mean, yerr=[[m - min(v) for m, v in zip(mean, per)], [max(v) - m for m, v in zip(mean, per)]],
                    fmt="none", ecolor="black", capsize=2, lw=0.8)
    ax.set_xticks(range(len(nodes)), nodes)
    g = runs[0].get("groups") or {}
    ax.set_ylabel(f"rounds in T = {g.get('window_s', '?')} s")
    ax.set_title(f"Rounds each worker completed in the window T (groups of p = {g.get('p', '?')} from the ready queue)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _transfers(run: dict) -> list[dict]:
    t = run.get("transfers") or {}
    cols = t.get("columns") or []
    return [dict(zip(cols, row)) for row in t.get("rows") or []]


def _gantt_iteration(results: dict) -> tuple[dict, dict] | None:
    """(run, iteration) to draw: the main variant's first correct-or-not measured iteration."""
    for r in results.get("runs", []):
        for it in r.get("iterations", []):
            if not it.get("warmup"):
                return r, it
    return None


def gantt_figure(results: dict, path: Path) -> Path | None:
    pick = _gantt_iteration(results)
    if pick is None:
        return None
    run, it = pick
    rows = [t for t in _transfers(run) if t["iteration"] == it["iteration"]]
    if not rows:
        return None
    t0 = min(t["send_start_ns"] for t in rows)
    pairs = sorted({(t["src"], t["dst"]) for t in rows})
    ypos = {p: i for i, p in enumerate(pairs)}
    flows = sorted({t.get("flow", 0) for t in rows})
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    fig = _figure(1.3 + 0.28 * len(pairs))
    ax = fig.add_subplot()
    for t in rows:
        k = flows.index(t.get("flow", 0))
        y = ypos[(t["src"], t["dst"])]
        ax.plot([(t["send_start_ns"] - t0) / 1e9, (t["recv_start_ns"] - t0) / 1e9], [y, y], color=cmap(k % 20), lw=1, zorder=1)
        ax.barh(y, (t["recv_end_ns"] - t["recv_start_ns"]) / 1e9, left=(t["recv_start_ns"] - t0) / 1e9,
                height=0.7, color=cmap(k % 20), edgecolor="black", linewidth=0.3, zorder=2,
                hatch="////" if t.get("route") else None)  # came over an auxiliary path
    ax.set_yticks(range(len(pairs)), [f"{a}->{b}" for a, b in pairs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the iteration's first send")
    ax.set_title(f"{run['variant']}, repetition {run['repetition']}, iteration {it['iteration']}: "
                 f"transfers: bar = receiving, thin line = sent but not yet arriving; colour = flow ({len(flows)})"
                 + ("; hatched = over an auxiliary path" if any(t.get("route") for t in rows) else ""),
                 fontsize=10)
    return _save(fig, path)


def _graph(results: dict) -> nx.DiGraph:
    g = nx.DiGraph()
    for lk in results.get("links", []):
        g.add_edge(lk["src"], lk["dst"], delay_ms=lk.get("delay_ms", 0.0), rate_mbps=lk["rate_mbps"])
    return g


def _configured(links: list[dict], events: list[dict], t_end: float) -> dict[tuple, list[tuple[float, float]]]:
    """Per direction: [(time, configured rate)] steps from results.links and the events
    (rate changes; link down/up and crashes drop a direction to 0)."""
    steps = {(lk["src"], lk["dst"]): [(0.0, lk["rate_mbps"])] for lk in links}
    rate = {k: v[0][1] for k, v in steps.items()}
    down: dict[tuple, int] = {k: 0 for k in steps}
    for ev in sorted(events, key=lambda e: e["t_s"]):
        t = ev["t_s"]
        kind = ev.get("event")
        if kind == "rate" and (ev["src"], ev["dst"]) in steps:
            rate[(ev["src"], ev["dst"])] = ev["rate_mbps"]
            touched = [(ev["src"], ev["dst"])]
        elif kind in ("link_down", "link_up"):
            touched = [k for k in ((ev["a"], ev["b"]), (ev["b"], ev["a"])) if k in steps]
            for k in touched:
                down[k] += 1 if kind == "link_down" else -1
        elif kind in ("host_crash", "host_up"):
            touched = [k for k in steps if ev["dc"] in k]
            for k in touched:
                down[k] += 1 if kind == "host_crash" else -1
        else:
            continue
        for k in touched:
            steps[k].append((t, 0.0 if down[k] > 0 else rate[k]))
    for k in steps:
        steps[k].append((t_end, steps[k][-1][1]))
    return steps


def links_figure(results: dict, path: Path) -> Path | None:
    """Goodput per link direction over all runs against its configured rate, with rate
    changes, faults and each run's start marked; None without transfers or links."""
    from testbed.routing import data_paths

    transfers = [t for r in results.get("runs", []) for t in _transfers(r)]
    g = _graph(results)
    if not transfers or not g.number_of_edges():
        return None
    # time origin: when the network came up if there are events to place (their t_s count
    # from it), else the first send (a sweep's shared network came up long before)
    net_t0 = results.get("events_t0_s") if any("t_s" in e for e in results.get("events", [])) else None
    first = min(t["send_start_ns"] for t in transfers) / 1e9
    origin = net_t0 if net_t0 is not None else first
    end = max(t["recv_end_ns"] for t in transfers) / 1e9 - origin
    nbins = 200
    width = max(end, 1e-3) / nbins
    load = _binned_load(transfers, data_paths(g), origin, nbins, width)
    starts = [(min(t["send_start_ns"] for t in _transfers(r)) / 1e9 - origin, r) for r in results.get("runs", [])
              if _transfers(r)]
    hops = sorted(load, key=lambda h: -sum(load[h]))[:MAX_LINK_PANELS]
    hops.sort()
    # events are timed from the network's start: without it they cannot be placed
    events = [e for e in results.get("events", []) if "t_s" in e] if net_t0 is not None else []
    steps = _configured(links=results.get("links", []), events=events, t_end=end)
    ncols = 3
    nrows = math.ceil(len(hops) / ncols)
    fig = _figure(0.6 + 1.9 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True)
    xs = [(i + 0.5) * width for i in range(nbins)]
    for ax, hop in zip(axes.flat, hops):
        _link_panel(ax, hop, xs, [b * 8 / width / 1e6 for b in load[hop]], steps, events, starts)
    for x, r in starts:  # which variant ran when, on the first row
        for ax in axes[0]:
            ax.text(x, 0.98, f"{r['variant']}#{r['repetition']}", transform=ax.get_xaxis_transform(), fontsize=6,
                    va="top", ha="left", rotation=90, color="#555555", clip_on=True)
    for ax in list(axes.flat)[len(hops):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("seconds since the network came up" if net_t0 is not None else "seconds since the first send",
                  fontsize=9)
    fig.supylabel("Mbit/s", fontsize=9)
    more = f" (the {MAX_LINK_PANELS} busiest of {len(load)})" if len(load) > MAX_LINK_PANELS else ""
    fig.suptitle(f"Goodput per link direction over all runs vs configured rate{more}; "
                 "grey: rate change, red: fault", fontsize=10)
    return _save(fig, path)


def _binned_load(transfers: list[dict], paths: dict, origin: float, nbins: int,
                 width: float) -> dict[tuple, list[float]]:
    """Per link direction: bytes received in each of ``nbins`` time bins of ``width``
    seconds from ``origin``, each transfer spread evenly over its receiving time on every
    hop of its route."""
    load: dict[tuple, list[float]] = {}
    for t in transfers:
        a, b = t["recv_start_ns"] / 1e9 - origin, t["recv_end_ns"] / 1e9 - origin
        route = paths.get((t["src"], t["dst"]), [t["src"], t["dst"]])
        for hop in zip(route, route[1:]):
            bins = load.setdefault(hop, [0.0] * nbins)
            dur = max(b - a, 1e-9)
            i0, i1 = int(a // width), min(nbins - 1, int(b // width))
            for i in range(max(0, i0), i1 + 1):
                overlap = min(b, (i + 1) * width) - max(a, i * width)
                if overlap > 0:
                    bins[i] += t["bytes"] * overlap / dur
    return load


def _link_panel(ax, hop: tuple, xs: list[float], mbps: list[float], steps: dict, events: list[dict],
                starts: list[tuple]) -> None:
    """One direction's panel: goodput, the configured rate's steps, the events that touch
    it (faults everywhere, rate changes on their own link) and each run's start."""
    ax.plot(xs, mbps, color="#1f77b4", lw=0.8, label="goodput")
    if hop in steps:
        st = steps[hop]
        ax.step([s[0] for s in st], [s[1] for s in st], where="post", color="#d62728", ls="--", lw=1,
                label="configured")
    for e in events:
        fault = e["event"] != "rate"
        if fault or hop in ((e.get("src"), e.get("dst")),):
            ax.axvline(e["t_s"], color="red" if fault else "grey", lw=0.8, ls=":" if not fault else "-")
    for x, _ in starts:
        ax.axvline(x, color="#bbbbbb", lw=0.6)
    ax.set_title(f"{hop[0]}->{hop[1]}", fontsize=8)
    ax.tick_params(labelsize=7)


def _numeric(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def sweep_figure(sweep: dict, path: Path) -> Path | None:
    """Mean CCT against the first swept key, one line per (variant, other swept values)."""
    keys = sweep.get("keys") or []
    done = [p for p in sweep.get("points", []) if p.get("variants")]
    if not keys or not done:
        return None
    x_key, rest = keys[0], keys[1:]
    xvals = []
    for p in done:
        if p["values"].get(x_key) not in xvals:
            xvals.append(p["values"].get(x_key))
    numeric = _numeric(xvals)
    lines: dict[str, list[tuple]] = {}
    for p in done:
        other = ", ".join(f"{k}={p['values'].get(k)}" for k in rest)
        for v in p["variants"]:
            name = v["variant"] + (f" ({other})" if other else "")
            x = p["values"].get(x_key)
            lines.setdefault(name, []).append((x if numeric else xvals.index(x), v["cct_mean_s"], v["cct_min_s"],
                                               v["cct_max_s"], v.get("predicted_cct_s")))
    fig = _figure(4.8)
    ax = fig.add_subplot()
    for name, pts in sorted(lines.items()):
        pts = sorted((p for p in pts if p[1] is not None), key=lambda p: p[0])
        if not pts:
            continue
        ys = [p[1] for p in pts]
        ax.errorbar([p[0] for p in pts], ys, yerr=[[y - p[2] for y, p in zip(ys, pts)], [p[3] - y for y, p in
                                                                                        zip(ys, pts)]],
                    marker="o", capsize=3, label=name)
        pred = [(p[0], p[4]) for p in pts if p[4] is not None]
        if pred:
            ax.plot([p[0] for p in pred], [p[1] for p in pred], ls="--", lw=0.8, color=ax.lines[-1].get_color())
    if numeric and len(xvals) > 2 and min(xvals) > 0 and max(xvals) / min(xvals) >= 16:
        ax.set_xscale("log", base=2)
    if not numeric:
        ax.set_xticks(range(len(xvals)), [str(x) for x in xvals])
    ax.set_xlabel(x_key)
    ax.set_ylabel("CCT mean (s), bars: min .. max; dashed: predicted")
    ax.set_title(f"sweep {sweep.get('name', '')}: CCT against {x_key}")
    ax.legend(fontsize=7)
    return _save(fig, path)


# -- HTML ------------------------------------------------------------------------------
def _img(path: Path | None, alt: str) -> str:
    if path is None:
        return f"<p class='none'>{html.escape(alt)}: no data</p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f"<figure><img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'><figcaption>" \
           f"{html.escape(alt)} ({path.name})</figcaption></figure>"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _warnings(results: dict) -> list[str]:
    out = [f"emulation did not keep up: {w}" for w in results.get("emulation", {}).get("warnings", [])]
    if results.get("summary") and not results["summary"].get("correct", True):
        out.append("WRONG RESULT in at least one run (see the correct column)")
    out += [f"variant {v['label']} failed: {v['error']}" for v in results.get("variants", []) if v.get("error")]
    out += [f"event error: {e['error']}" for e in results.get("events", []) if "error" in e]
    return out


CSS = """body{font-family:sans-serif;margin:1.5em;max-width:1100px}table{border-collapse:collapse;font-size:85%;
margin:.5em 0;display:block;overflow-x:auto}td,th{border:1px solid #bbb;padding:2px 6px;text-align:right}th{background:#eee}
.warn{background:#fde2e1;border:2px solid #c00;color:#900;padding:.6em 1em;
font-weight:bold}
img{max-width:100%;border:1px solid #ddd}pre{background:#f6f6f6;padding:.5em;font-size:80%;overflow:auto;
max-height:30em}figure{margin:1em 0}
table.claims td{text-align:left}tr.reproduced td:nth-child(8){background:#dff0d8}
tr.not-reproduced td:nth-child(8){background:#fde2e1}tr.not-run td:nth-child(8),tr.not-comparable td:nth-child(8){background:#eee}"""

# The page marks on <body> how many images the browser decoded and any script errors, so a
# headless browser can check the page (tests/test_report.py).
CHECK_JS = """window.__errors=[];window.addEventListener('error',e=>window.__errors.push(String(e.message)));
window.addEventListener('load',()=>{const im=[...document.images];document.body.dataset.images=im.length;
document.body.dataset.imagesOk=im.filter(i=>i.complete&&i.naturalWidth>0).length;
document.body.dataset.errors=window.__errors.length;});"""


def _run_section(entry: dict, out: Path, n: int, table: bool = True) -> tuple[str, dict]:
    """HTML for one results.json (its variants table unless ``table`` is false: the page
    has it already); returns (html, figures)."""
    res, figs = entry["results"], {}
    exp = res["experiment"]
    figs["gantt"] = gantt_figure(res, out / f"gantt-{n}.png")
    figs["links"] = links_figure(res, out / f"links-{n}.png")
    figs["rounds"] = rounds_figure(res, out / f"rounds-{n}.png")
    parts = [f"<h2>{html.escape(exp['name'])} <small>({html.escape(str(entry['dir']))})</small></h2>"]
    parts += [f"<div class='warn'>WARNING: {html.escape(w)}</div>" for w in _warnings(res)]
    parts.append(_setup_line(exp))
    if table and res.get("variants"):
        parts.append(_table(variant_rows(res), VARIANT_COLUMNS))
    if res.get("processes"):  # an `exec` run
        parts.append(f"<p>command: <code>{html.escape(' '.join(res['command']))}</code></p>" + _table(
            [{"datacenter": dc, **p, "stdout": (p["stdout"].strip().splitlines() or [""])[-1]}
             for dc, p in res["processes"].items()], ["datacenter", "rank", "exit_code", "wall_s", "stdout"]))
    cold = [{"variant": r["variant"], "repetition": r["repetition"], "warmup_cct_s": ", ".join(
        f"{c:.4g}" for c in r.get("warmup_cct_s", []))} for r in res.get("runs", []) if r.get("warmup_cct_s")]
    if cold:
        parts.append("<h3>Cold (warm-up) iterations, left out of the CCT</h3>" +
                     _table(cold, ["variant", "repetition", "warmup_cct_s"]))
    lossy = [{"variant": r["variant"], "repetition": r["repetition"], **r["tcp"]} for r in res.get("runs", [])
             if r.get("tcp", {}).get("retrans_segs")]
    if lossy:
        parts.append("<h3>TCP's loss recovery in the measured iterations (not in the cost model)</h3>" +
                     _table(lossy, ["variant", "repetition", *TCP_FIELDS]))
    if figs["rounds"]:  # a groups run has no iterations (no timeline of one)
        parts.append(_img(figs["rounds"], "Rounds per worker in the window T"))
        faults = _group_faults(res)
        if faults:
            parts.append("<h3>Faults during the groups runs (§IV-B failover)</h3>" +
                         _table(faults, ["variant", "repetition", "fault", "why", "back_after_s", "tasks"]))
    else:
        parts.append(_img(figs["gantt"], "Timeline of one iteration"))
    parts.append(_img(figs["links"], "Goodput per link vs configured rate"))
    parts += _details(res)
    return "\n".join(parts), figs


def _setup_line(exp: dict) -> str:
    """The paragraph naming the experiment's topology, scale, size and rounds."""
    topo = exp.get("topology", {})
    return (f"<p>topology {html.escape(str(topo.get('name')))} ({len(topo.get('datacenters', []))} datacenters, "
            f"{len(topo.get('links', []))} links), scale {exp.get('scale')}, "
            f"{exp['workload'].get('bytes')} bytes, {exp.get('repetitions')} repetition(s), "
            + (f"groups of p = {g['p']} from the ready queue in a window T = {g['window_s']:g} s</p>"
               if (g := (exp.get("scheme") or {}).get("groups")) else
               f"{exp['workload'].get('iterations')} iteration(s) + {exp['workload'].get('warmup')} warm-up</p>"))


def _group_faults(res: dict) -> list[dict]:
    """One row per fault of the groups runs: what was lost, why, when it was back, and what
    became of the tasks it held."""
    return [{"variant": r["variant"], "repetition": r["repetition"],
             "fault": f"worker {f['node']} lost" if f.get("node") else "controller lost" if f.get("controller")
             else f"link {'-'.join(f['link'])} broken",
             "why": f.get("why", f"down {f['down_s']:g} s, {len(f.get('rejoined', {}))} workers rejoined"
                          if f.get("controller") else f"reported by {f.get('reported_by')}"
                          + (", back before the controller acted" if f.get("failover") is False else "")),
             "back_after_s": (f["back_ns"] - f["t_ns"]) / 1e9 if f.get("back_ns") else None,
             "tasks": ", ".join(f"{t['pid']} {t['outcome']}" + (f" to {t['replacement']}" if t.get("replacement")
                                                               else f" ({t['why']})" if t.get("why") else "")
                               for t in f.get("tasks", []))}
            for r in res.get("runs", []) for f in (r.get("groups") or {}).get("faults", [])]


def _details(res: dict) -> list[str]:
    """The folded-away parts: the events table, the links as shaped, the resolved
    experiment and the environment."""
    parts = []
    if res.get("events"):
        parts.append("<h3>Dynamics and faults</h3>" + _table(
            res["events"], sorted({k for e in res["events"] for k in e}, key=lambda k: (k != "t_s", k))))
    if res.get("links"):
        parts.append("<details><summary>Links as shaped</summary>" +
                     _table(res["links"], list(res["links"][0].keys())) + "</details>")
    parts.append("<details><summary>Experiment (fully resolved)</summary><pre>" +
                 html.escape(json.dumps(res["experiment"], indent=1, default=str)) + "</pre></details>")
    env = {k: v for k, v in res.get("environment", {}).items() if k != "capabilities"}
    parts.append("<details><summary>Environment</summary><pre>" +
                 html.escape(json.dumps({**env, "emulation": {k: v for k, v in res.get("emulation", {}).items()
                                                              if k != "relay"}}, indent=1, default=str))
                 + "</pre></details>")
    return parts


def write_report(folders: list[Path], out: Path | None = None, claims: str | None = None) -> Path:
    """Write figures, CSV tables and ``report.html`` for ``folders`` into ``out`` (default:
    the only folder); return the HTML file's path.  ``claims``: a section (HTML, from
    ``reproduce``) put first: the papers' claims beside what was measured."""
    entries = [load(Path(f)) for f in folders]
    out = Path(out) if out else Path(folders[0])
    out.mkdir(parents=True, exist_ok=True)
    runs = [e for e in entries if e["kind"] == "run"]
    sweeps = [e for e in entries if e["kind"] == "sweep"]
    for s in sweeps:  # a sweep's points are results folders of their own
        for p in s["sweep"].get("points", []):
            if p.get("dir") and (s["dir"] / p["dir"] / "results.json").exists():
                runs.append({**load(s["dir"] / p["dir"]), "point": p})
    names = [e["results"]["experiment"]["name"] for e in runs]
    cct_entries, vrows, lrows = [], [], []
    for e in runs:
        res = e["results"]
        # several results: prefix each variant with its sweep point, experiment or folder name
        tag = "" if len(runs) == 1 else f"p{e['point']['index']}:" if "point" in e else \
            f"{res['experiment']['name']}:" if names.count(res["experiment"]["name"]) == 1 else f"{e['dir'].name}:"
        for v in res.get("variants", []):
            cct_entries.append((tag + v["label"], {**v, "_runs": [r for r in res.get("runs", [])
                                                                  if r["variant"] == v["label"]]}))
        vrows += [{**r, "point": e["point"]["index"]} if "point" in e else r for r in variant_rows(res)]
        lrows += link_rows(res)
    write_csv(out / "variants.csv", vrows, (["point"] if any("point" in r for r in vrows) else []) + VARIANT_COLUMNS)
    write_csv(out / "links.csv", lrows, LINK_COLUMNS)
    body = ["<h1>testbed report</h1>"] + ([claims] if claims else [])
    warns = [w for e in runs for w in _warnings(e["results"])] + [
        f"sweep point {p['index']} failed: {p['error']}" for s in sweeps for p in s["sweep"].get("points", [])
        if p.get("error")]
    if warns:
        body.append("<div class='warn'>" + "<br>".join(html.escape(w) for w in warns) + "</div>")
    for i, s in enumerate(sweeps):
        fig = sweep_figure(s["sweep"], out / f"sweep-{i}.png")
        body.append(f"<h2>Sweep {html.escape(s['sweep'].get('name', ''))} over "
                    f"{html.escape(', '.join(s['sweep'].get('keys', [])))}</h2>" + _img(fig, "Sweep"))
        body.append(_table(sweep_rows(s["sweep"]), sweep_columns(s["sweep"])))
    if cct_entries:
        body.append("<h2>CCT per variant</h2>" + _img(cct_figure(cct_entries, out / "cct.png"), "CCT per variant"))
        body.append(_table(vrows, (["point"] if any("point" in r for r in vrows) else []) + VARIANT_COLUMNS))
    body.append("<p>Tables as CSV: variants.csv, links.csv" + (", sweep.csv" if sweeps else "") + "</p>")
    for n, e in enumerate(runs if len(runs) <= 8 else runs[:8]):  # per-run detail; sweeps: the first points
        section, _ = _run_section(e, out, n, table=len(runs) > 1)
        body.append(section)
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>testbed report</title><style>{CSS}</style>"
            f"<script>{CHECK_JS}</script></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    path = out / "report.html"
    path.write_text(page)
    return path


def sweep_columns(sweep: dict) -> list[str]:
    return ["point", *sweep.get("keys", []), "status"] + VARIANT_COLUMNS[1:]


def sweep_rows(sweep: dict) -> list[dict]:
    """The combined sweep table: one row per (point, variant); a failed point one row."""
    rows = []
    for p in sweep.get("points", []):
        base = {"point": p["index"], **p["values"], "status": p.get("status")}
        if p.get("variants"):
            rows += [{**base, **v} for v in p["variants"]]
        else:
            rows.append({**base, "error": p.get("error")})
    return rows
