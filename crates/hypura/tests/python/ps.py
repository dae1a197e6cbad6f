"""Print `/api/ps` of a running `hypura serve` as one JSON line: python3 ps.py BASE_URL."""
import json
import sys

import httpx

print(json.dumps(httpx.get(f"{sys.argv[1]}/api/ps").json()))
