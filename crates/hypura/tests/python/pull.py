"""Pull a model through `/api/pull` with the `ollama` client, streaming its progress, list it,
delete it through `/api/delete`, and print what was seen as one JSON line:
python3 pull.py BASE_URL NAME."""
import json
import sys

import ollama

base, name = sys.argv[1], sys.argv[2]
client = ollama.Client(host=base, timeout=300)
statuses, last = [], None
for part in client.pull(name, stream=True):
    statuses.append(part.status)
    if part.digest:
        last = part
tags = [model.model for model in client.list().models]
client.delete(name)
after = [model.model for model in client.list().models]
print(json.dumps({
    "statuses": statuses,
    "last_digest": last.digest if last else None,
    "last_completed": last.completed if last else None,
    "last_total": last.total if last else None,
    "tags": tags,
    "tags_after_delete": after,
}))
