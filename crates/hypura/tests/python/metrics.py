"""Scrape BASE/metrics and parse it with the Prometheus project's own parser (strict
OpenMetrics text); print every sample as {"name{key=\"value\",...}": value}, labels sorted by key."""
import json
import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families

base = sys.argv[1]
with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
    content_type = response.headers["Content-Type"]
    text = response.read().decode()
assert content_type.startswith("application/openmetrics-text"), content_type
samples = {}
for family in text_string_to_metric_families(text):
    for sample in family.samples:
        labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
        samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
print(json.dumps(samples))
