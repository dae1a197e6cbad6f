"""A chat longer than the context, through the real `ollama` Python client and plain HTTP.

Run by `tests/it/prompt_cache.rs`: python3 long_chat.py BASE_URL MODEL CONTEXT. The server keeps
the system prompt and the newest messages, as Ollama does; `truncate: false` gets the overflow
error instead. Exits non-zero on the first failed check.
"""
import sys

import httpx
import ollama


def check(condition, message):
    if not condition:
        raise AssertionError(message)


base, model, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
messages = [{"role": "system", "content": "You are a terse assistant. Answer in one short sentence."}]
for turn in range(24):
    messages.append({"role": "user", "content": f"Note {turn}: the parcel for customer {turn * 13} left depot {turn % 4} on day {turn + 1} of the month."})
    messages.append({"role": "assistant", "content": f"Noted: parcel {turn}, customer {turn * 13}, depot {turn % 4}, day {turn + 1}."})
messages.append({"role": "user", "content": "Which depot did the last parcel leave from?"})
greedy = {"temperature": 0, "num_predict": 16, "seed": 1}

client = ollama.Client(host=base, timeout=300)
answer = client.chat(model=model, messages=messages, options=greedy)
check(answer.done, answer)
check(answer.message.content.strip(), f"empty answer: {answer}")
check(0 < answer.prompt_eval_count < context, f"the prompt was {answer.prompt_eval_count} tokens in a context of {context}")
print(f"ollama client: {answer.prompt_eval_count} prompt tokens, {answer.message.content!r}")

streamed = "".join(part.message.content for part in client.chat(model=model, messages=messages, options=greedy, stream=True))
check(streamed == answer.message.content, f"streamed {streamed!r} against {answer.message.content!r}")

body = {"model": model, "messages": messages, "stream": False, "options": greedy}
reply = httpx.post(f"{base}/api/chat", json=body, timeout=300).json()
dropped = reply.get("hypura_messages_dropped", 0)
check(0 < dropped < len(messages) - 1, f"{dropped} messages dropped: {reply}")
check(dropped % 2 == 0, f"the cut is not at a user message: {dropped} dropped")
print(f"dropped {dropped} of {len(messages)} messages")

refused = httpx.post(f"{base}/api/chat", json={**body, "truncate": False}, timeout=300)
check(refused.status_code == 400 and "prompt is too long" in refused.json()["error"], refused.text)
print("truncate false:", refused.json()["error"])
