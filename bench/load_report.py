"""The load bench's markdown tables and its plot (throughput against p50/p99 latency)."""

from __future__ import annotations

from pathlib import Path


def _errors(row: dict) -> str:
    if not row["n_errors"]:
        return "0"
    return ", ".join(f"{n}x {status}" for status, n in sorted(row["errors_by_status"].items()))


def level_table(levels: list[dict]) -> list[str]:
    lines = [
        "| clients | requests | req/s | answer tok/s | p50 (ms) | p90 (ms) | p99 (ms) | errors "
        "| differing / checked | GPU busy % |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in levels:
        lat = r.get("latency_ms", {})
        inv = r["invariance"]
        busy = "-" if r.get("gpu_busy_pct") is None else f"{r['gpu_busy_pct']:.0f}"
        lines.append(
            f"| {r['clients']} | {r['n']} | {r['req_per_s']:.1f} | {r['tok_per_s']:,.0f} "
            f"| {lat.get('p50', 0):.1f} | {lat.get('p90', 0):.1f} | {lat.get('p99', 0):.1f} "
            f"| {_errors(r)} | {inv['differing']} / {inv['checked']} | {busy} |"
        )
    return lines


def saturation(row: dict) -> list[str]:
    """Where the time goes at the level of most requests/s."""
    per_request = row.get("cpu_ms_per_request", {})
    cores = ", ".join(
        f"{k} {v:.2f} ({per_request.get(k, 0):.1f} ms a request)"
        for k, v in sorted(row["cpu_cores"].items())
    )
    nats = row.get("nats", {})
    busy = row.get("gpu_busy_pct")
    lines = [
        f"Saturation ({row['clients']} clients, {row['req_per_s']:.1f} req/s): GPU busy "
        f"{'-' if busy is None else busy} %; CPU cores used: {cores}.",
    ]
    if nats:
        lines.append(
            f"nats-server: in {nats.get('in_bytes_per_s', 0) / 1e6:.0f} MB/s, out "
            f"{nats.get('out_bytes_per_s', 0) / 1e6:.0f} MB/s "
            f"({nats.get('in_msgs_per_s', 0):.0f} / {nats.get('out_msgs_per_s', 0):.0f} msgs/s)."
        )
    cohort = row["stages"].get("capture.cohort_lanes")
    if cohort:
        lines.append(
            f"Capture: {cohort['forwards_per_s']} forwards/s, {cohort['mean_lanes']} lanes each."
        )
    alloc = row["stages"].get("capture.allocator")
    if alloc:
        lines.append(f"Capture's CUDA allocator over the level: {_events(alloc)}.")
    reads = row["stages"].get("worker.cohort_blocks")
    if reads:
        lines.append(
            f"Readout: {reads['executions_per_s']} engine executions/s, "
            f"{reads['mean_blocks']} blocks each."
        )
    lines += ["", "| stage | mean per request (ms) | requests in it at once |", "|---|---:|---:|"]
    for name, s in row["stages"].items():
        if "mean_ms" in s:
            lines.append(f"| {name} | {s['mean_ms']:.2f} | {s['in_flight']:.2f} |")
    return lines


def ar_lines(doc: dict) -> list[str]:
    ar = doc.get("ar", {})
    if "batches" not in ar:
        return [f"AR decode: not measured ({ar.get('skipped') or ar.get('failed', '')[-300:]})"]
    lines = [
        f"AR decode ({ar['mode']}, HF generate, {ar['new_tokens']} new tokens, prompt "
        f"{ar['prompt_len']}):",
        "",
        "| batch | answer (s) | tok/s |",
        "|---:|---:|---:|",
    ]
    for b in sorted(ar["batches"].values(), key=lambda b: b["batch"]):
        if "answer_s" in b:
            lines.append(f"| {b['batch']} | {b['answer_s']:.3f} | {b['tokens_per_s']:,.0f} |")
        else:
            lines.append(f"| {b['batch']} | - | {b.get('skipped', 'not finished')} |")
    r = doc.get("ratio")
    if r:
        lines.append(
            f"\nAt {r['clients']} clients / batch {r['clients']}, {r['depth']} tokens: stack "
            f"{r['stack_tok_per_s']:,.0f} tok/s over AR {r['ar_tok_per_s']:,.0f} = "
            f"**{r['stack_over_ar']:.2f}x**"
        )
    return lines


def _latency_row(name: str, row: dict) -> str:
    lat = row.get("latency_ms", {})
    cells = " | ".join(f"{lat[k]:,.1f}" if k in lat else "-" for k in ("p50", "p90", "p99", "max"))
    return f"| {name} | {row['n']} | {cells} | {_errors(row)} |"


def fairness_lines(f: dict) -> list[str]:
    """The fairness level: small requests alone and beside the big clients, and the ratio."""
    big, small, beside, bigs = f["big"], f["small"], f["beside"], f["big_requests"]
    p99 = "-" if f["p99_ratio"] is None else f"{f['p99_ratio']:.2f}x"
    verdict = "met" if f["meets_target"] else "missed"
    inv = [f[k]["invariance"] for k in ("alone", "beside")]
    lim = f["limits"]
    lines = [
        f"**Fairness**: {f['big_clients']} client(s) sending maximal requests back to back "
        f"({big['n']} distinct prompts of {big['prompt_len']:,} tokens a request, a lane each, "
        f"max_tokens {big['max_tokens']:,}; "
        f"the stack's limits: `STATEBLOCK_PROMPT_LEN_MAX` {lim['prompt_len_max']}, `_MAX_LANES` "
        f"{lim['max_lanes']}, `_ANSWER_DEPTH_MAX` {lim['answer_depth_max']}), beside one client "
        f"sending small ones (prompt {small['prompt_len']} tokens, {small['depth']}-token "
        f"answers, {small['requests']} alone, then as many beside)",
        "",
        "| requests | n | p50 (ms) | p90 (ms) | p99 (ms) | max (ms) | errors |",
        "|---|---:|---:|---:|---:|---:|---|",
        _latency_row("small, alone", f["alone"]),
        _latency_row(f"small, beside {f['big_clients']} big", beside),
        _latency_row("big", bigs),
        "",
        f"p99 beside / alone = **{p99}** (target <= {f['target_p99_ratio']:g}x: {verdict}; p50 "
        f"{f['p50_ratio']}x); {beside['beside_big']} of {beside['n']} small requests were sent "
        f"while a big one was in flight; small answers differing from their prompt alone: "
        f"{inv[0]['differing'] + inv[1]['differing']} / {inv[0]['checked'] + inv[1]['checked']}; "
        f"every big answer {big['n']} x {big['max_tokens']:,} tokens: "
        f"{bigs['all_full_depth'] if bigs['n_ok'] else '-'}.",
    ]
    if beside.get("slowest"):
        lines.append("Slowest beside (ms; from the nearest big request's send / reply): " + ", ".join(
            f"{w['ms']:,.1f} ({w['from_big_send_ms']} / {w['from_big_reply_ms']})"
            for w in beside["slowest"]
        ) + ".")  # fmt: skip
    st = f.get("stages_beside", {})
    cohort, forward, readout = (st.get(k) for k in
                                ("capture.cohort_lanes", "capture.forward", "worker.readout"))  # fmt: skip
    if cohort and forward and readout:
        lines.append(
            f"Beside: the capture ran {cohort['forwards']} forwards of {cohort['mean_lanes']} "
            f"lanes, {forward['mean_ms']:,.1f} ms a request in its forward stage"
            f"{_forward_split(st)}; the readout {readout['mean_ms']:,.1f} ms a request (the big "
            f"requests' counted in)." + _alone_stages(f.get("stages_alone", {}))
        )
    if st.get("capture.forward.cohort"):
        lines.append(
            "By route, beside: " + "; ".join(_route(st, route, what) for route, what in
                                             (("cohort", "the small requests (in cohorts)"),
                                              ("parts", "the maximal ones (in parts)"))
                                             if st.get(f"capture.forward.{route}")) + "."
        )  # fmt: skip
    if st.get("capture.allocator"):
        lines.append(f"Capture's CUDA allocator beside: {_events(st['capture.allocator'])}.")
    lags = [(what, f.get(f"loop_lag_{what}")) for what in ("alone", "beside")]
    if any(lag for _, lag in lags):
        lines.append("Event loops woken late (a 10 ms sleep; runtime.loop_lag): " + "; ".join(
            f"{what}: {_stalls(lag)}" for what, lag in lags if lag) + ".")  # fmt: skip
    return lines


def _stalls(lag: dict) -> str:
    """Each process's late wake-ups over one phase."""
    return ", ".join(
        f"{name} {s['over_10ms']} over 10 ms, {s['over_50ms']} over 50 ms of {s['wakeups']:,} "
        f"(worst <= {s['worst_ms']} ms)"
        for name, s in sorted(lag.items())
    )


def _events(alloc: dict) -> str:
    return ", ".join(f"{n:,} {event}" for event, n in sorted(alloc.items()))


def _forward_split(st: dict) -> str:
    """The forward stage's parts: until a request's first forward began on a thread, and
    its forwards' own time there (the big requests' counted in)."""
    wait, run = st.get("capture.forward_wait"), st.get("capture.forward_run")
    if not (wait and run):
        return ""
    return f" ({wait['mean_ms']:,.1f} waiting for a forward, {run['mean_ms']:,.1f} in forwards)"


def _route(st: dict, route: str, what: str) -> str:
    """One route's stages: its requests' capture forward stage (waiting, running), sign, and
    its blocks' readout (a block read in parts is the readout's `parts` route)."""
    f, w, r, sign = (st.get(f"capture.{k}.{route}") for k in
                     ("forward", "forward_wait", "forward_run", "sign"))  # fmt: skip
    split = f" ({w['mean_ms']:,.1f} waiting, {r['mean_ms']:,.1f} in forwards)" if w and r else ""
    signed = f", {sign['mean_ms']:,.1f} ms to sign" if sign else ""
    read = st.get(f"worker.readout.{route}")
    blocks = f"; {read['n']} blocks read in {read['mean_ms']:,.1f} ms" if read else ""
    return (f"{what}: {f['n']} requests, {f['mean_ms']:,.1f} ms in the capture's forward "
            f"stage{split}{signed}{blocks}")  # fmt: skip


def _alone_stages(st: dict) -> str:
    forward, readout = st.get("capture.forward"), st.get("worker.readout")
    if not (forward and readout):
        return ""
    return (f" Alone: {forward['mean_ms']:,.1f} ms in the forward{_forward_split(st)}, "
            f"{readout['mean_ms']:,.1f} ms in the readout.")  # fmt: skip


def markdown(doc: dict) -> str:
    c = doc["config"]
    workers = "the default (by engine)" if c["workers"] is None else c["workers"]
    if c.get("stack") == "in-process":
        where, shape = (
            "one `stateblock up` process",
            f"every service in one process, {workers} workers",
        )
    else:
        where = "one process per service"
        shape = (f"{c.get('captures', 1)} capture and {c.get('readout_procs', 1)} readout "
                 f"processes of {workers} workers")  # fmt: skip
    lines = [
        f"### Load, {where} ({c['scale']}, {c['device_name']})",
        f"prompt {c['prompt_len']} tokens"
        + (f", `n` {c['n']} (a request's answers of its prompt)" if c.get("n") else "")
        + ", temperature 0, ignore_eos; capture compile "
        f"`{c['capture_compile']}`, {shape}, blocks storage "
        f"`{c['blocks_storage']}`, {c['level_s']} s a level"
        + (", under CUDA MPS" if c.get("mps") else "")
        + "".join(f", `{name}={value}`" for name, value in c.get("env") or ()),
    ]
    for depth, entry in doc.get("load", {}).items():
        ref = entry["reference"]
        lines += ["", f"**{depth}-token answers** (reference pass: {ref['n_ok']} prompts alone, "
                  f"p50 {ref.get('latency_ms', {}).get('p50', 0):.1f} ms)", ""]  # fmt: skip
        lines += level_table(entry["levels"])
        if entry["levels"]:
            lines += ["", *saturation(max(entry["levels"], key=lambda r: r["req_per_s"]))]
    if doc.get("fairness"):
        lines += ["", *fairness_lines(doc["fairness"])]
    lines += ["", *ar_lines(doc)]
    stall = doc.get("stall")
    if stall:
        lines += ["", f"Capture compile `{stall['capture_compile']}` (stack start "
                  f"{stall['stack_start_s']} s):", "", *level_table([stall])]  # fmt: skip
    if doc.get("skipped"):
        lines.append(f"\nskipped: {'; '.join(doc['skipped'])}")
    lines.append(f"\nsetup: {doc.get('setup', {})}; total {doc.get('elapsed_s', 0):.0f} s")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> bool:
    """Latency (p50 solid, p99 dashed, log scale) against requests/s, a line per answer
    depth, each point labelled with its client count; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    for depth, entry in doc.get("load", {}).items():
        rows = [r for r in entry["levels"] if "latency_ms" in r]
        if not rows:
            continue
        x = [r["req_per_s"] for r in rows]
        (line,) = ax.plot(x, [r["latency_ms"]["p50"] for r in rows], "o-", label=f"{depth} p50")
        ax.plot(x, [r["latency_ms"]["p99"] for r in rows], "s--", color=line.get_color(),
                label=f"{depth} p99")  # fmt: skip
        for r in rows:
            ax.annotate(str(r["clients"]), (r["req_per_s"], r["latency_ms"]["p50"]),
                        textcoords="offset points", xytext=(4, -10), fontsize=7)  # fmt: skip
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("requests/s (answer depth in the legend; labels: clients)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"stateblock under load, {doc['config']['device_name']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run of no levels plots nothing
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
