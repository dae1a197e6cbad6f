"""The soak's driver (see scripts/bench/soak): Python's standard library only, on loopback."""
import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

RSS_GROWTH_LIMIT = 0.10
RSS_SAMPLE_SECONDS = 10


def parse_args():
    parser = argparse.ArgumentParser()
    for flag in ("--binary", "--model", "--out"):
        parser.add_argument(flag, required=True)
    for flag, default in (("--clients", 8), ("--port", 18180), ("--context", 2048), ("--parallel", 4), ("--threads", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("serve_flags", nargs="*")
    return parser.parse_args()


def system_prompt():
    """An agent's long system prompt, the same in every session (about 1,500 tokens)."""
    lines = ["You are the operations assistant of a warehouse. Follow every rule below."]
    for rule in range(60):
        lines.append(f"Rule {rule}: shelf {rule % 17} holds item {rule * 7} and is checked every {rule % 5 + 1} days.")
    return "\n".join(lines)


SYSTEM = system_prompt()


class Server:
    """One `hypura serve` process; `generation` counts restarts."""

    def __init__(self, args, cache):
        self.args, self.cache, self.generation, self.process = args, cache, 0, None

    def start(self):
        self.generation += 1
        log = open(os.path.join(self.args.out, f"serve-{self.generation}.log"), "w")
        command = [self.args.binary, "serve", self.args.model, "--host", "127.0.0.1", "--port", str(self.args.port),
                   "--context", str(self.args.context), "--parallel", str(self.args.parallel),
                   "--threads", str(self.args.threads), "--max-queue", str(self.args.clients * 2),
                   "--keep-alive=-1", "--prompt-cache", self.cache, "--metrics", *self.args.serve_flags]
        environment = dict(os.environ, HYPURA_LOG=os.environ.get("HYPURA_LOG", "hypura=info"))
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=environment)
        deadline = time.time() + 120
        while True:
            try:
                status, _ = request("GET", "/health", port=self.args.port, timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.time() > deadline:
                raise SystemExit(f"soak: serve did not start (see {log.name})")
            time.sleep(0.1)

    def terminate(self):
        """SIGTERM; returns (exit status, seconds to exit)."""
        started = time.time()
        self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(timeout=300)
        return status, time.time() - started

    def rss(self):
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


def request(method, path, body=None, port=18180, timeout=600, raw=None):
    """One exchange; returns (status, parsed JSON or text)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        connection.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode(errors="replace")
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text
    finally:
        connection.close()


def stream(path, body, port, cancel_after=None):
    """A streamed request: returns (status, lines read); with cancel_after, closes the connection
    after that many lines, as a client that goes away does."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            response.read()
            return response.status, 0
        lines = 0
        for line in response:
            if line.strip():
                lines += 1
            if cancel_after is not None and lines >= cancel_after:
                break
        return 200, lines
    finally:
        connection.close()


KINDS = ["agent", "generate_stream", "openai_stream", "openai_completion", "cancelled", "malformed"]


def one(kind, index, model, port):
    """Run one request of `kind`; returns its HTTP status."""
    question = f"Request {index}: which shelf holds item {index % 400}?"
    options = {"temperature": 0.7, "seed": index, "num_predict": 24}
    if kind == "agent":
        status, _ = request("POST", "/api/chat", {"model": model, "stream": False, "options": options, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}, port=port)
        return status
    if kind == "generate_stream":
        return stream("/api/generate", {"model": model, "prompt": question, "options": options}, port)[0]
    if kind == "openai_stream":
        return stream("/v1/chat/completions", {"model": model, "stream": True, "max_tokens": 24, "messages": [
            {"role": "user", "content": question}]}, port)[0]
    if kind == "openai_completion":
        return request("POST", "/v1/completions", {"model": model, "prompt": question, "max_tokens": 24}, port=port)[0]
    if kind == "cancelled":
        return stream("/api/generate", {"model": model, "prompt": question, "options": dict(options, num_predict=200)},
                      port, cancel_after=2)[0]
    # Malformed: a body that is not JSON, and one with a wrong type; both must be 400.
    path = "/api/chat" if index % 2 else "/v1/chat/completions"
    raw = b'{"model": "' + model.encode() + b'", "messages": [' if index % 4 < 2 else \
        json.dumps({"model": model, "messages": "not a list"}).encode()
    status, _ = request("POST", path, raw=raw, port=port)
    return status


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.failures = []
        self.unavailable = 0

    def add(self, kind, status):
        with self.lock:
            key = f"{kind} {status}"
            self.counts[key] = self.counts.get(key, 0) + 1
            expected = 400 if kind == "malformed" else 200
            if status != expected and status != 503:
                self.failures.append(f"{kind}: HTTP {status}")

    def total(self):
        with self.lock:
            return sum(self.counts.values())


def main():
    args = parse_args()
    cache = os.path.join(args.out, "prompt-cache")
    model = os.path.splitext(os.path.basename(args.model))[0].lower()
    server = Server(args, cache)
    server.start()
    started = time.time()
    end = started + args.minutes * 60
    warmup = min(120.0, args.minutes * 60 / 5)
    tally = Tally()
    restarting = threading.Event()
    stop = threading.Event()
    rss_rows = []

    def client(number):
        index = number
        while not stop.is_set():
            kind = KINDS[index % len(KINDS)]
            try:
                status = one(kind, index, model, args.port)
                tally.add(kind, status)
                if status == 503:
                    # Full, or draining: come back later, as a client that reads Retry-After does.
                    time.sleep(1.0)
            except OSError as error:
                # Refused or reset while the server restarts: that is the stop, not an error.
                if restarting.is_set() or server.process.poll() is not None:
                    with tally.lock:
                        tally.unavailable += 1
                    time.sleep(0.5)
                else:
                    with tally.lock:
                        tally.failures.append(f"{kind}: {error!r}")
            index += args.clients

    def sampler():
        while not stop.wait(RSS_SAMPLE_SECONDS):
            rss = server.rss()
            if rss is not None and not restarting.is_set():
                row = (round(time.time() - started), server.generation, rss, tally.total())
                rss_rows.append(row)
                print(f"soak: {row[0]:>5} s  server {row[1]}  RSS {rss / 2**20:8.1f} MiB  requests {row[3]}", flush=True)

    threads = [threading.Thread(target=client, args=(number,), daemon=True) for number in range(args.clients)]
    threads.append(threading.Thread(target=sampler, daemon=True))
    for thread in threads:
        thread.start()

    # The stop in the middle of the load, then a restart.
    time.sleep(max(0.0, started + (end - started) / 2 - time.time()))
    restarting.set()
    stop_status, stop_seconds = server.terminate()
    leftovers = sorted(name for name in os.listdir(cache) if name.startswith(".tmp-"))
    restarted_at = time.time() - started
    server.start()
    # The agent's system prompt, saved by the first server, must come from disk now.
    status, probe = request("POST", "/api/chat", {"model": model, "stream": False, "options": {"temperature": 0, "num_predict": 4},
                                                   "messages": [{"role": "system", "content": SYSTEM},
                                                                {"role": "user", "content": "Which shelf holds item 7?"}]},
                            port=args.port)
    restarting.clear()
    prefix_loaded = probe.get("hypura_prompt_cache_loaded", 0) if isinstance(probe, dict) else 0
    prompt_tokens = probe.get("prompt_eval_count", 0) if isinstance(probe, dict) else 0

    time.sleep(max(0.0, end - time.time()))
    stop.set()
    for thread in threads:
        thread.join(timeout=700)
    final_status, final_seconds = server.terminate()
    final_leftovers = sorted(name for name in os.listdir(cache) if name.startswith(".tmp-"))

    # RSS: each server's samples after its warm-up against its first sample after the warm-up.
    growth = {}
    for generation, since in ((1, 0.0), (2, restarted_at)):
        rows = [row for row in rss_rows if row[1] == generation and row[0] >= since + warmup]
        if len(rows) >= 2:
            growth[generation] = max(row[2] for row in rows) / rows[0][2] - 1
    with open(os.path.join(args.out, "rss.csv"), "w") as csv:
        csv.write("seconds,server,rss_bytes,requests\n")
        csv.writelines(f"{row[0]},{row[1]},{row[2]},{row[3]}\n" for row in rss_rows)

    problems = list(tally.failures[:20])
    if len(tally.failures) > 20:
        problems.append(f"... and {len(tally.failures) - 20} more")
    problems += [f"server {generation}: RSS grew {value:.1%} after its warm-up" for generation, value in growth.items() if value > RSS_GROWTH_LIMIT]
    if stop_status != 0 or final_status != 0:
        problems.append(f"a SIGTERM exited with {stop_status} and {final_status}")
    if leftovers or final_leftovers:
        problems.append(f"temporary files left after a stop: {leftovers + final_leftovers}")
    if status != 200 or prefix_loaded * 2 < prompt_tokens:
        problems.append(f"after the restart {prefix_loaded} of {prompt_tokens} prompt tokens came from the cache (HTTP {status})")
    summary = {
        "model": args.model, "serve_flags": args.serve_flags, "clients": args.clients, "minutes": args.minutes,
        "requests": tally.total(), "by_kind_and_status": dict(sorted(tally.counts.items())),
        "unavailable_during_restart": tally.unavailable, "failures": len(tally.failures),
        "sigterm_mid_load": {"exit_status": stop_status, "seconds_to_exit": round(stop_seconds, 2), "temporaries_left": leftovers},
        "restart": {"prompt_tokens": prompt_tokens, "loaded_from_cache": prefix_loaded},
        "final_sigterm": {"exit_status": final_status, "seconds_to_exit": round(final_seconds, 2)},
        "rss_growth_after_warmup": {str(key): round(value, 4) for key, value in growth.items()},
        "rss_mib_min_max": [round(min(row[2] for row in rss_rows) / 2**20, 1), round(max(row[2] for row in rss_rows) / 2**20, 1)] if rss_rows else None,
        "passed": not problems, "problems": problems,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as file:
        json.dump(summary, file, indent=2)
    print(json.dumps(summary, indent=2))
    sys.exit(0 if not problems else 1)


if __name__ == "__main__":
    main()
