"""A bounded load test on loopback: CLIENTS concurrent clients for SECONDS against a running
`hypura serve`, mixing Ollama and OpenAI requests, streamed and not.

python3 load.py BASE_URL MODEL SECONDS CLIENTS SERVER_PID

Every request must finish (no request lost) without an error, and the server's resident memory
after the run must be within 64 MiB of what it was after a warm-up (memory flat). Prints one JSON
summary line; exits non-zero when a check fails. Traffic goes to BASE_URL only, which the caller
puts on loopback, and stops by itself after SECONDS.
"""
import json
import sys
import threading
import time

import ollama
import openai

RSS_GROWTH_LIMIT_BYTES = 64 << 20


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def one_request(kind, index, native, compatible, model):
    """Run one request and return the tokens it generated; raise on anything wrong."""
    prompt = f"Request {index}: write a sentence about the number {index}."
    options = {"num_predict": 16, "temperature": 0.7, "seed": index}
    if kind == 0:
        parts = list(native.generate(model=model, prompt=prompt, options=options, stream=True))
        if not parts[-1].done or parts[-1].eval_count is None:
            raise AssertionError(f"stream ended without done: {parts[-1]}")
        return parts[-1].eval_count
    if kind == 1:
        reply = native.chat(model=model, messages=[{"role": "user", "content": prompt}], options=options)
        if not reply.done:
            raise AssertionError(f"chat not done: {reply}")
        return reply.eval_count
    chunks = list(compatible.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16, seed=index, stream=True, stream_options={"include_usage": True}))
    if chunks[-1].usage is None or not any(chunk.choices and chunk.choices[0].finish_reason for chunk in chunks):
        raise AssertionError("stream ended without a finish chunk and usage")
    return chunks[-1].usage.completion_tokens


def main():
    base, model, seconds, clients, pid = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    native = ollama.Client(host=base, timeout=120)
    compatible = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)

    # Warm up every parallel sequence so the context and its buffers are at full size.
    warm = [threading.Thread(target=one_request, args=(kind % 3, kind, native, compatible, model)) for kind in range(clients)]
    for thread in warm:
        thread.start()
    for thread in warm:
        thread.join()
    rss_before = rss_bytes(pid)

    deadline = time.time() + seconds
    lock = threading.Lock()
    totals = {"started": 0, "finished": 0, "tokens": 0, "errors": []}

    def client(number):
        index = number
        while time.time() < deadline:
            with lock:
                totals["started"] += 1
            try:
                tokens = one_request(index % 3, index, native, compatible, model)
                with lock:
                    totals["finished"] += 1
                    totals["tokens"] += tokens
            except Exception as error:  # every failure is counted and reported
                with lock:
                    totals["errors"].append(f"{type(error).__name__}: {error}")
            index += clients

    started = time.time()
    threads = [threading.Thread(target=client, args=(number,)) for number in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.time() - started
    rss_after = rss_bytes(pid)
    summary = {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "requests": totals["started"],
        "finished": totals["finished"],
        "errors": len(totals["errors"]),
        "first_errors": totals["errors"][:5],
        "generated_tokens": totals["tokens"],
        "tokens_per_sec": round(totals["tokens"] / elapsed, 1),
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_after_mib": round(rss_after / 2**20, 1),
    }
    print(json.dumps(summary))
    failures = []
    if totals["finished"] == 0:
        failures.append("no request finished")
    if totals["finished"] != totals["started"]:
        failures.append("requests were lost")
    if totals["errors"]:
        failures.append("requests failed")
    if rss_after - rss_before > RSS_GROWTH_LIMIT_BYTES:
        failures.append("memory grew")
    if failures:
        print("load test failed: " + ", ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
