#!/usr/bin/env python3
"""Summarise a scripts/bench/bench-limited run: tok/s of each side, ratios, bytes per token and the
fraction of the physical limit 1 / max(t_compute, bytes_streamed_per_token / disk_bandwidth).
Also writes OUT/summary.json (each run's tok/s, exit status and peak memory, the limits), which
`hypura summary-picture` draws."""
import glob
import json
import os
import sys

out, limit, file_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None


def tg(report, side):
    if not report:
        return None
    for result in report["results"]:
        if result["test"].startswith("tg") and result.get(side):
            return result[side]["mean"]
    return None


hypura = load("hypura.json")
reference = load("compute-reference.json")
profile = load("profile.json") or {}
# The profile's sustained rate (streaming's chunks held over passes of the file) where it was
# measured, else its best short burst.
disk_profile = profile.get("disk") or {}
disk_source = "sustained" if disk_profile.get("sustained") else "best direct"
disk = (disk_profile.get("sustained") or disk_profile.get("best_direct") or {}).get("bytes_per_sec")
# A run that read faster while busy than the profile says shows the profile low: the limit
# takes the faster rate, so that no run exceeds its limit.
busy = (hypura or {}).get("busy_read_bytes_per_sec")
if busy and (not disk or busy > disk):
    disk, disk_source = busy, f"Hypura's reads while busy, faster than the profile's {disk_source} {disk / 1e9 if disk else float('nan'):.2f} GB/s"
rows = []
known = ["llama-mmap", "llama-mmap-norepack", "llama-no-mmap", "llama-fit", "llama-exps-cpu"]
found = sorted(os.path.basename(path)[: -len(".status.json")] for path in glob.glob(os.path.join(out, "llama-*.status.json")))
peers = [peer for peer in known if peer in found] + [peer for peer in found if peer not in known]
for label, side in [("hypura", "hypura"), ("hypura-b", "hypura")] + [(peer, "llama_cpp") for peer in peers]:
    if label != "hypura" and not load(label + ".status.json"):
        continue
    status = load(label + ".status.json") or {}
    rows.append((label, tg(load(label + ".json"), side), status.get("status"), status.get("peak_bytes"), status.get("gpu_peak_bytes")))

ours = rows[0][1]
print(f"limit {limit / 2**30:.2f} GiB for a {file_bytes / 2**30:.2f} GiB file; disk {disk / 1e9 if disk else float('nan'):.2f} GB/s ({disk_source})")
print("| run | tg tok/s | Hypura ÷ run | exit | peak memory | peak device memory |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for label, rate, status, peak, gpu_peak in rows:
    ratio = f"{ours / rate:.2f}" if ours and rate else "-"
    shown = f"{rate:.3f}" if rate else {137: "killed (OOM)", 124: "over the time limit"}.get(status, "-")
    peak_text = f"{peak / 2**30:.2f} GiB" if peak else "-"
    gpu_text = f"{gpu_peak / 2**30:.2f} GiB" if gpu_peak else "-"
    print(f"| {label} | {shown} | {ratio} | {status} | {peak_text} | {gpu_text} |")
limit_rate, limit_note = None, None
if hypura and reference:
    # The faster of the two compute times measured: resident with the same kernels, and
    # Hypura's own while streaming (stall excluded); a limit a run could beat is no limit.
    t_compute = min(1 / tg(reference, "hypura"), hypura.get("compute_seconds_per_token") or float("inf"))
    # The host cache's warm fill beside a device pool reads for no token: not a pass's bytes.
    per_token = (hypura.get("bytes_read_per_token") or 0) - (hypura.get("warm_bytes_per_token") or 0)
    planned = hypura.get("planned_bytes_per_token") or 0
    # Expert-stream plans the worst case (every pick a miss); what streams is what the cache
    # missed, so the limit uses the bytes read.
    streamed = per_token if hypura.get("expert_hit_rate") is not None else planned
    t_io = streamed / disk if disk else 0
    limit_rate = 1 / max(t_compute, t_io)
    limit_note = f"compute {t_compute * 1e3:.1f} ms, reads {t_io * 1e3:.1f} ms a token"
    print(f"t_compute {t_compute * 1e3:.0f} ms (the faster of resident with the same kernels and Hypura's own); planned {planned / 1e6:.0f} MB/token streamed, measured {per_token / 1e6:.0f} MB/token")
    print(f"physical limit {limit_rate:.3f} tok/s -> Hypura reaches {ours / limit_rate:.2f} of it" if ours else "physical limit: Hypura did not finish")
    print(f"load: Hypura {hypura.get('hypura_load_seconds') or float('nan'):.2f} s; stall fraction {hypura.get('stall_fraction') or 0:.2f}")
for label in ["hypura", "hypura-b"] + peers:
    report = load(label + ".json")
    if report and report.get("llama_cpp_placement"):
        print(f"{label}: llama.cpp placement {report['llama_cpp_placement']}")
    if report and report.get("expert_hit_rate") is not None:
        line = f"{label}: expert hit rate {report['expert_hit_rate']:.3f}, {(report.get('bytes_read_per_token') or 0) / 1e6:.0f} MB read per token"
        prefetch = report.get("prefetch_issued_used_cancelled")
        if prefetch:
            issued, used, cancelled = prefetch
            line += f"; prefetch {issued} issued, {used} used ({used / issued:.2f}), {cancelled} cancelled"
        print(line)

# The plan's prediction, made before each run from what earlier runs of the model recorded.
predictions = {}
for label in ["hypura", "hypura-b"]:
    report = load(label + ".json") or {}
    prediction = report.get("prediction") or {}
    predicted, measured = prediction.get("decode_tokens_per_sec"), tg(report, "hypura")
    if predicted and measured:
        predictions[label] = predicted
        basis = ", ".join(
            f"{what} from {prediction[what + '_from']}" for what in ["compute", "disk_rate", "hit_rate"] if prediction.get(what + "_from")
        )
        print(f"{label}: predicted {predicted:.3f} tok/s ({basis}; {prediction.get('bytes_per_token', 0) / 1e6:.1f} MB a token), measured {measured:.3f}: measured / predicted {measured / predicted:.2f}")

model_name = (hypura or {}).get("model_description") or os.path.basename(out.rstrip("/"))
summary = {
    "title": f"{model_name} ({file_bytes / 2**30:.2f} GiB) in {limit / 2**30:.2f} GiB of memory, cold: tg tok/s and peak memory",
    "memory_limit_bytes": limit,
    "limit_tokens_per_sec": limit_rate,
    "limit_note": limit_note,
    "runs": [{"label": label, "tokens_per_sec": rate, "predicted_tokens_per_sec": predictions.get(label), "status": status, "peak_bytes": peak, "gpu_peak_bytes": gpu_peak} for label, rate, status, peak, gpu_peak in rows],
}
with open(os.path.join(out, "summary.json"), "w") as handle:
    json.dump(summary, handle, indent=1)
