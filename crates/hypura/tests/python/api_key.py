"""A server started with an API key, through the real `ollama` and `openai` Python clients.

Run by `tests/it/server_clients.rs`: python3 api_key.py BASE_URL MODEL KEY. Clients that send the
key get answers; clients without it, or with another, get 401 (and nothing about the models);
the liveness checks stay open. Exits non-zero on the first failed check.
"""
import sys

import httpx
import ollama
import openai


def check(condition, message):
    if not condition:
        raise AssertionError(message)


base, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
greedy = {"temperature": 0, "num_predict": 4, "seed": 1}
messages = [{"role": "user", "content": "Say hi."}]

check(httpx.get(f"{base}/").status_code == 200, "GET / needs no key")
check(httpx.get(f"{base}/api/version").status_code == 200, "GET /api/version needs no key")

keyed = ollama.Client(host=base, headers={"Authorization": f"Bearer {key}"}, timeout=300)
answer = keyed.chat(model=model, messages=messages, options=greedy)
check(answer.done and answer.message.content, f"keyed ollama client: {answer}")
check(any(entry.model.startswith(model) for entry in keyed.list().models), "keyed ollama list")
print(f"ollama client with the key: {answer.message.content!r}")

for headers in [{}, {"Authorization": "Bearer not-the-key"}]:
    try:
        ollama.Client(host=base, headers=headers, timeout=300).chat(model=model, messages=messages, options=greedy)
        raise AssertionError(f"ollama client with {headers} was answered")
    except ollama.ResponseError as error:
        check(error.status_code == 401, f"ollama client with {headers}: {error.status_code} {error}")
    refused = httpx.get(f"{base}/api/tags", headers=headers)
    check(refused.status_code == 401 and model not in refused.text, f"/api/tags with {headers}: {refused.text}")

client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=300)
completion = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
check(completion.choices[0].message.content, f"keyed openai client: {completion}")
print(f"openai client with the key: {completion.choices[0].message.content!r}")
try:
    openai.OpenAI(base_url=f"{base}/v1", api_key="not-the-key", timeout=300).models.list()
    raise AssertionError("openai client with another key was answered")
except openai.AuthenticationError as error:
    check(error.status_code == 401, f"openai client with another key: {error}")
print("api key: 401 without it or with another, answers with it")
