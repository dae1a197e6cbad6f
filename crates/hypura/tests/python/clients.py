"""The real `ollama` and `openai` Python clients against a running `hypura serve`.

Run by `tests/it/server_clients.rs`: python3 clients.py BASE_URL MODEL [EXTRA_MODEL...]. MODEL is
the Gemma 3 270M base model (or --extra-only); each EXTRA_MODEL gets a shorter pass (generate
and chat, streamed and not). Exits non-zero on the first failed check.
"""
import json
import sys
import time

import httpx
import ollama
import openai


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def expect_status(call, status, text=None):
    try:
        call()
    except ollama.ResponseError as error:
        check(error.status_code == status, f"expected {status}, got {error.status_code}: {error.error}")
        check(text is None or text in error.error, f"{text!r} not in {error.error!r}")
        return
    raise AssertionError(f"expected an error {status}")


def active_requests(base, model):
    models = httpx.get(f"{base}/api/ps").json()["models"]
    return sum(entry.get("hypura_active_requests", 0) for entry in models if entry["name"].startswith(model))


def ollama_client(base, model):
    client = ollama.Client(host=base, timeout=300)
    tag = model if ":" in model else f"{model}:latest"

    names = [entry.model for entry in client.list().models]
    check(tag in names, f"{tag} not in {names}")
    shown = client.show(model)
    check(shown.modelinfo["general.architecture"] == "gemma3", shown.modelinfo.get("general.architecture"))
    check(shown.details.family == "gemma3", shown.details)

    greedy = {"temperature": 0, "num_predict": 12}
    whole = client.generate(model=model, prompt="The capital of France is", raw=True, options=greedy)
    check(whole.done and whole.done_reason == "length" and whole.eval_count == 12, whole)
    check(whole.response.strip(), "empty response")
    check(whole.total_duration > 0 and whole.prompt_eval_count > 0, whole)
    parts = list(client.generate(model=model, prompt="The capital of France is", raw=True, options=greedy, stream=True))
    check(parts[-1].done and not any(part.done for part in parts[:-1]), "done only on the last chunk")
    check("".join(part.response for part in parts) == whole.response, "streamed text differs")

    # Options: a stop string cuts the answer; a seed makes sampling reproducible.
    stop_word = whole.response.split()[1] if len(whole.response.split()) > 1 else None
    if stop_word:
        stopped = client.generate(model=model, prompt="The capital of France is", raw=True, options={**greedy, "stop": [stop_word]})
        check(stopped.done_reason == "stop" and stop_word not in stopped.response, stopped.response)
    seeded = {"temperature": 1.0, "top_k": 40, "seed": 1234, "num_predict": 16}
    first = client.generate(model=model, prompt="Once upon a time", options=seeded).response
    second = client.generate(model=model, prompt="Once upon a time", options=seeded).response
    check(first == second, f"seeded runs differ: {first!r} vs {second!r}")

    # system and context
    with_system = client.generate(model=model, prompt="Hi", system="Answer in French.", options=greedy)
    check(with_system.context and len(with_system.context) > 0, "no context")
    follow = client.generate(model=model, prompt="And then?", context=with_system.context, options=greedy)
    check(follow.prompt_eval_count > len(with_system.context), "context was not used")

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat(model=model, messages=messages, options=greedy)
    check(chat.message.role == "assistant" and chat.message.content and chat.done, chat)
    chunks = list(client.chat(model=model, messages=messages, options=greedy, stream=True))
    check("".join(chunk.message.content for chunk in chunks) == chat.message.content, "streamed chat differs")
    check(chunks[-1].done_reason == "length", chunks[-1])

    # format "json": the answer is a JSON object.
    few_shot = 'Country capitals as JSON.\nFrance: {"capital": "Paris"}\nGermany: {"capital": "Berlin"}\nItaly:'
    answer = client.generate(model=model, prompt=few_shot, raw=True, format="json", options={"temperature": 0, "num_predict": 64})
    check(answer.done_reason == "stop", answer)
    parsed = json.loads(answer.response)
    check(isinstance(parsed, dict), parsed)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    structured = client.chat(model=model, messages=[{"role": "user", "content": "Describe a cat as JSON."}], format=schema, options={"temperature": 0, "num_predict": 96})
    check(structured.done_reason == "stop", structured)
    cat = json.loads(structured.message.content)
    check(isinstance(cat["name"], str) and isinstance(cat["age"], int), cat)

    running = client.ps().models
    check(any(entry.model == tag for entry in running), running)
    entry = next(entry for entry in running if entry.model == tag)
    check(entry.size > 0 and entry.size_vram == 0, entry)

    vectors = client.embed(model=model, input=["the king", "the queen"]).embeddings
    check(len(vectors) == 2 and len(vectors[0]) == 640, len(vectors[0]))
    check(abs(sum(value * value for value in vectors[0]) - 1.0) < 1e-3, "not normalised")
    legacy = client.embeddings(model=model, prompt="the king").embedding
    check(len(legacy) == 640, len(legacy))

    # Error codes reach the client as ResponseError with the status.
    expect_status(lambda: client.generate(model="no-such-model", prompt="x"), 404, "not found")
    expect_status(lambda: client.chat(model="no-such-model", messages=messages), 404)
    expect_status(lambda: client.show("no-such-model"), 404)
    expect_status(lambda: client.generate(model=model, prompt="x", options={"temperature": "hot"}), 400, "temperature")
    expect_status(lambda: client.generate(model=model, prompt="x", options={"top_p": 7.0}), 400, "top_p")
    expect_status(lambda: client.generate(model=model, prompt="x", think=True), 400, "thinking")
    expect_status(lambda: client.generate(model=model, prompt="x", format={"type": "thing"}), 400, "unknown type")
    expect_status(lambda: client.embed(model="no-such-model", input="x"), 404)

    # A client that disconnects: its generation stops and the server keeps serving.
    stream = client.generate(model=model, prompt="Tell me a very long story.", options={"num_predict": 100000}, stream=True)
    next(stream)
    next(stream)
    check(active_requests(base_url, model) == 1, "the long generation is not running")
    stream.close()
    deadline = time.time() + 10
    while active_requests(base_url, model) != 0:
        check(time.time() < deadline, "the disconnected generation was not cancelled")
        time.sleep(0.05)
    after = client.generate(model=model, prompt="Hello", options={"num_predict": 4})
    check(after.done, "the server stopped serving after a disconnect")
    print("ollama client: ok")


def openai_client(base, model):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    ids = [entry.id for entry in client.models.list().data]
    check(any(identifier.startswith(model) for identifier in ids), ids)
    check(client.models.retrieve(model).object == "model", "retrieve")

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    check(whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length", whole)
    check(whole.usage.completion_tokens == 10 and whole.usage.prompt_tokens > 0, whole.usage)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}))
    check(chunks[0].choices[0].delta.role == "assistant", chunks[0])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    check(text == whole.choices[0].message.content, f"{text!r} vs {whole.choices[0].message.content!r}")
    finish = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    check(len(finish) == 1 and finish[0].choices[0].finish_reason == "length", finish)
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10, chunks[-1])

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    check(completion.choices[0].text and completion.usage.completion_tokens == 8, completion)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if chunk.choices)
    check(streamed == completion.choices[0].text, f"{streamed!r} vs {completion.choices[0].text!r}")

    structured = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a cat as JSON."}], max_tokens=96, temperature=0,
                                                 response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}}})
    check(isinstance(json.loads(structured.choices[0].message.content)["age"], int), structured)

    # The client asks for base64 by default and decodes it itself.
    embedding = client.embeddings.create(model=model, input=["the king", "the queen"])
    check(len(embedding.data) == 2 and len(embedding.data[0].embedding) == 640, len(embedding.data[0].embedding))
    floats = client.embeddings.create(model=model, input="the king", encoding_format="float")
    check(max(abs(a - b) for a, b in zip(floats.data[0].embedding, embedding.data[0].embedding)) < 1e-5, "base64 and float differ")

    for call, kind in [
        (lambda: client.chat.completions.create(model="no-such-model", messages=messages), openai.NotFoundError),
        (lambda: client.chat.completions.create(model=model, messages=[]), openai.BadRequestError),
        (lambda: client.chat.completions.create(model=model, messages=messages, temperature=-1), openai.BadRequestError),
        (lambda: client.completions.create(model="no-such-model", prompt="x"), openai.NotFoundError),
    ]:
        try:
            call()
        except kind as error:
            check(isinstance(error.body, dict) and "message" in error.body, error.body)
        else:
            raise AssertionError(f"expected {kind.__name__}")
    print("openai client: ok")


def extra_model(base, model):
    client = ollama.Client(host=base, timeout=300)
    options = {"temperature": 0, "num_predict": 8}
    whole = client.generate(model=model, prompt="hello", options=options)
    check(whole.done and whole.eval_count == 8, whole)
    parts = list(client.generate(model=model, prompt="hello", options=options, stream=True))
    check("".join(part.response for part in parts) == whole.response, "streamed text differs")
    chat = client.chat(model=model, messages=[{"role": "user", "content": "hi"}], options=options)
    check(chat.done and chat.eval_count == 8, chat)
    check(any(entry.model.startswith(model) for entry in client.ps().models), "not in ps")
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    # Greedy, as the chat above: sampled, a tiny forged model can draw its end token early.
    check(oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0).usage.completion_tokens == 4, "openai")
    print(f"{model}: ok")


if __name__ == "__main__":
    base_url, main_model, *extras = sys.argv[1:]
    if main_model == "--extra-only":
        main_model = None
    else:
        ollama_client(base_url, main_model)
        openai_client(base_url, main_model)
    for extra in extras:
        extra_model(base_url, extra)
