#!/usr/bin/env python3
"""Routing statistics of `hypura run --trace` files: per layer, how evenly experts are used
(normalised entropy, 1 = uniform), the share of picks that go to the layer's most picked tenth
of the experts (0.1 = uniform; real routers give theirs about 0.8), and how many of a token's
picks were not picked for the token before (0 = stuck, 1 - k/E = independent random picks).
Averages over layers.

    scripts/bench/routing-stats.py N_EXPERT TRACE.jsonl [TRACE.jsonl ...]
"""
import collections
import json
import math
import sys


def stats(path, n_expert):
    rows_by_layer = collections.defaultdict(list)
    with open(path) as trace:
        for line in trace:
            record = json.loads(line)
            rows_by_layer[record["layer"]].extend(record["experts"])
    entropies, changes, top_tenth = [], [], []
    for rows in rows_by_layer.values():
        counts = collections.Counter(expert for row in rows for expert in row)
        total = sum(counts.values())
        entropy = -sum(c / total * math.log(c / total) for c in counts.values())
        entropies.append(entropy / math.log(n_expert))
        tenth = max(1, n_expert // 10)
        top_tenth.append(sum(c for _, c in counts.most_common(tenth)) / total)
        for before, after in zip(rows, rows[1:]):
            changes.append(len(set(after) - set(before)) / len(after))
    k = len(next(iter(rows_by_layer.values()))[0])
    return {
        "trace": path,
        "layers": len(rows_by_layer),
        "tokens_per_layer": len(next(iter(rows_by_layer.values()))),
        "usage_entropy": sum(entropies) / len(entropies),
        "top_tenth_share": sum(top_tenth) / len(top_tenth),
        "new_picks_per_token": sum(changes) / len(changes),
        "random_new_picks": 1 - k / n_expert,
    }


if __name__ == "__main__":
    n_expert = int(sys.argv[1])
    for path in sys.argv[2:]:
        s = stats(path, n_expert)
        print(f"{s['trace']}: {s['layers']} layers x {s['tokens_per_layer']} tokens, usage entropy {s['usage_entropy']:.3f} (1 = uniform), "
              f"top tenth of experts {s['top_tenth_share']:.3f} of picks, "
              f"new picks per token {s['new_picks_per_token']:.3f} (independent random: {s['random_new_picks']:.3f})")
