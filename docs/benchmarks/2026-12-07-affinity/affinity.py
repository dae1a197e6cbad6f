#!/usr/bin/env python3
"""Would reading a layer's likely misses ahead, by which experts follow which from one layer to
the next, pay under real routing?

From the recorded picks (data/routing/MODEL-*.jsonl.gz, ten prompts), leave one prompt out at a
time: learn from the other nine which experts of layer L+1 follow each expert of layer L, and
which experts each layer picks most (a cache of the C most picked). On the held-out prompt, at
each layer and token, rank layer L+1's experts the cache does not hold by the sum of their
counts after layer L's actual picks, and read the top K ahead. Prints, per cache size, the
misses per layer and token and the share of them the K reads would have caught, and the reads
per miss caught (the bandwidth it costs).

    docs/benchmarks/2026-12-07-affinity/affinity.py data/routing qwen3-30b-a3b
"""
import collections
import glob
import gzip
import json
import sys


def load(path):
    tokens = collections.defaultdict(dict)
    with gzip.open(path, "rt") as lines:
        for line in lines:
            record = json.loads(line)
            tokens[record["pos"]][record["layer"]] = record["experts"]
    return tokens


def main(folder, model):
    prompts = [load(path) for path in sorted(glob.glob(f"{folder}/{model}-*.jsonl.gz"))]
    n_layer = 1 + max(layer for prompt in prompts for token in prompt.values() for layer in token)
    n_expert = 1 + max(e for prompt in prompts for token in prompt.values() for picks in token.values() for e in picks)
    print(f"{model}: {len(prompts)} prompts, {n_layer} layers, {n_expert} experts")
    for share in (0.5, 0.75, 0.875):
        cached = int(n_expert * share)
        caught = collections.Counter()
        misses = layer_tokens = 0
        for held_out, test in enumerate(prompts):
            follows = collections.defaultdict(collections.Counter)
            popular = collections.defaultdict(collections.Counter)
            for index, prompt in enumerate(prompts):
                if index == held_out:
                    continue
                for token in prompt.values():
                    for layer, picks in token.items():
                        popular[layer].update(picks)
                        for expert in picks:
                            follows[(layer, expert)].update(token.get(layer + 1, []))
            cache = {layer: {e for e, _ in popular[layer].most_common(cached)} for layer in range(n_layer)}
            for token in test.values():
                for layer in range(n_layer - 1):
                    if layer not in token or layer + 1 not in token:
                        continue
                    missed = set(token[layer + 1]) - cache[layer + 1]
                    scores = collections.Counter()
                    for expert in token[layer]:
                        scores.update(follows[(layer, expert)])
                    ranked = [e for e, _ in scores.most_common() if e not in cache[layer + 1]]
                    for k in (1, 2, 4):
                        caught[k] += len(missed & set(ranked[:k]))
                    misses += len(missed)
                    layer_tokens += 1
        row = ", ".join(
            f"{k} read{'s' if k > 1 else ''}: {caught[k] / max(misses, 1):.2f} of misses caught, "
            f"{k * layer_tokens / max(caught[k], 1):.1f} reads a miss caught"
            for k in (1, 2, 4)
        )
        print(f"cache {cached}/{n_expert} a layer: {misses / layer_tokens:.2f} misses a layer and token; {row}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
