"""A local stand-in for the hub's download paths, for `scripts/tools/test-webui`'s pull: every GGUF
file in DIR is served as `hf.co/hypura/local:<its quantization>` under
`/api/models/hypura/local/tree/main` (sizes and SHA-256 as LFS oids) and
`/hypura/local/resolve/main/FILE` (with single ranges). Standard library only.

python3 scripts/tools/fake-hub.py DIR PORT"""
import hashlib
import http.server
import json
import os
import sys

root, port = sys.argv[1], int(sys.argv[2])
files = sorted(name for name in os.listdir(root) if name.endswith(".gguf"))
hashes = {}
for name in files:
    digest = hashlib.sha256()
    with open(os.path.join(root, name), "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    hashes[name] = digest.hexdigest()


class Hub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/api/models/hypura/local/tree/main"):
            tree = [{"type": "file", "path": name, "size": os.path.getsize(os.path.join(root, name)),
                     "lfs": {"oid": hashes[name], "size": os.path.getsize(os.path.join(root, name))}} for name in files]
            body = json.dumps(tree).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        prefix = "/hypura/local/resolve/main/"
        name = self.path[len(prefix):] if self.path.startswith(prefix) else None
        if name not in hashes:
            self.send_error(404)
            return
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        first, last, status = 0, size - 1, 200
        wanted = self.headers.get("Range")
        if wanted and wanted.startswith("bytes="):
            start, _, end = wanted[6:].partition("-")
            first, last, status = int(start), min(int(end), size - 1) if end else size - 1, 206
        self.send_response(status)
        self.send_header("Content-Length", str(last - first + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.end_headers()
        with open(path, "rb") as handle:
            handle.seek(first)
            left = last - first + 1
            while left > 0:
                chunk = handle.read(min(left, 1 << 20))
                self.wfile.write(chunk)
                left -= len(chunk)

    def log_message(self, *arguments):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", port), Hub).serve_forever()
