#!/usr/bin/env python3
"""Summary of scripts/bench/bench-rpc: tok/s, link bytes and round trips per token, predicted against
measured time per token, peak memory; then the planner's choice at every delay.

    scripts/bench/rpc-summary.py OUT "DELAYS" "SWITCH_DELAYS"
"""
import json
import pathlib
import sys


def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tg(report, side):
    for result in (report or {}).get("results", []):
        if result["test"].startswith("tg") and result.get(side):
            return result[side]["mean"]
    return None


def main():
    out = pathlib.Path(sys.argv[1])
    delays = sys.argv[2].split()
    switch = sys.argv[3].split()
    rows = [("hypura-local", "hypura", "-")]
    for delay in delays:
        rows += [(f"hypura-rpc-{delay}", "hypura", delay), (f"llama-rpc-{delay}", "llama_cpp", delay)]
        if (out / f"hypura-rpc-keyed-{delay}.json").exists():
            rows.append((f"hypura-rpc-keyed-{delay}", "hypura", delay))
    local = tg(load(out / "hypura-local.json"), "hypura")
    print("| run | link delay (ms) | tg tok/s | vs Hypura local | link KB/token | round trips/token | predicted ms/token | measured ms/token | local peak | worker peaks | status |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for label, side, delay in rows:
        report = load(out / f"{label}.json")
        status = load(out / f"{label}.status.json") or {}
        rate = tg(report, side)
        mib = lambda value: f"{value / 2**20:.0f} MiB" if value else "-"
        predicted = (report or {}).get("predicted_seconds_per_token") if side == "hypura" else None
        prefix = "" if side == "hypura" else "llama_cpp_"
        link = (report or {}).get(f"{prefix}link_bytes_per_token")
        trips = (report or {}).get(f"{prefix}link_round_trips_per_token")
        print(
            f"| {label} | {delay} | {rate:.2f} | {rate / local:.2f}× | {link / 1e3 if link else 0:.1f} | {trips or 0:.1f} | "
            f"{predicted * 1e3 if predicted else float('nan'):.1f} | {1e3 / rate:.1f} | {mib(status.get('peak_bytes'))} | "
            f"{', '.join(mib(peak) for peak in status.get('worker_peak_bytes', []))} | exit {status.get('status')}, {status.get('workers_alive', '?')} workers alive |"
            if rate and local
            else f"| {label} | {delay} | - | - | - | - | - | - | {mib(status.get('peak_bytes'))} | {', '.join(mib(peak) for peak in status.get('worker_peak_bytes', []))} | exit {status.get('status')}, {status.get('workers_alive', '?')} workers alive |"
        )
    for delay in delays:
        keyless = tg(load(out / f"hypura-rpc-{delay}.json"), "hypura")
        keyed = tg(load(out / f"hypura-rpc-keyed-{delay}.json"), "hypura")
        if keyless and keyed:
            print(f"\nsealed links at {delay} ms: {keyed:.2f} tok/s against {keyless:.2f} keyless, {keyed / keyless:.3f}×")
    print()
    print("| link delay (ms) | planner's choice | predicted ms/token with the workers | streaming locally alone |")
    print("| ---: | --- | ---: | ---: |")
    for delay in delays + switch:
        report = load(out / f"inspect-{delay}.json")
        if not report:
            print(f"| {delay} | (no plan) | - | - |")
            continue
        plan = report["plan"]
        remote = plan.get("remote")
        if remote:
            layers = f"layers {remote['layers']['start']}-{remote['layers']['end'] - 1} on the workers"
            local = remote.get("local_seconds_per_token")
            local = f"{local * 1e3:.1f}" if local is not None else "cannot run"
            print(f"| {delay} | {layers} | {remote['predicted_seconds_per_token'] * 1e3:.1f} | {local} |")
        else:
            print(f"| {delay} | local streaming: {plan.get('remote_unused', '')[:90]} | - | - |")


if __name__ == "__main__":
    main()
