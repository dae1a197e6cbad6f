#!/usr/bin/env python3
"""Writes the server_bodies fuzz target's seeds into fuzz/corpus/server_bodies: one request per
endpoint family, with tools, options, formats and schemas (the first byte picks the endpoint, as
hypura::server::fuzz::ENDPOINTS lists them; the rest is the body)."""
import json
import pathlib

ENDPOINTS = ["/api/generate", "/api/chat", "/api/embed", "/api/embeddings", "/api/show",
             "/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                       "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name"]}
MODEL = "tiny-qwen3"
SEEDS = {
    "generate-plain": ("/api/generate", {"model": MODEL, "prompt": "Why is the sky blue?", "stream": False,
                                         "options": {"temperature": 0, "num_predict": 4, "top_k": 20, "top_p": 0.9, "seed": 7, "stop": ["\n"]}}),
    "generate-raw-stream": ("/api/generate", {"model": MODEL, "prompt": "def fib(n):", "raw": True,
                                              "options": {"num_predict": 4, "repeat_penalty": 1.1, "num_keep": -1}}),
    "generate-json": ("/api/generate", {"model": MODEL, "prompt": "a person", "format": "json", "stream": False}),
    "generate-schema": ("/api/generate", {"model": MODEL, "prompt": "a person", "format": SCHEMA, "stream": False, "keep_alive": "5m"}),
    "generate-context": ("/api/generate", {"model": MODEL, "prompt": "and then", "context": [1, 2, 3], "shift": False,
                                           "options": {"num_ctx": 128}}),
    "generate-load": ("/api/generate", {"model": MODEL, "keep_alive": 0}),
    "chat-tools": ("/api/chat", {"model": MODEL, "messages": [
        {"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}], "tools": [TOOL], "stream": False, "think": True}),
    "chat-format": ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "format": SCHEMA, "think": "high",
                                  "options": {"temperature": 0.5, "min_p": 0.1, "mirostat": 2}}),
    "chat-images": ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "look", "images": ["aGVsbG8="]}]}),
    "embed": ("/api/embed", {"model": MODEL, "input": ["one", "two"], "truncate": True, "dimensions": 8}),
    "embeddings": ("/api/embeddings", {"model": MODEL, "prompt": "hello"}),
    "show": ("/api/show", {"model": MODEL, "verbose": True}),
    "openai-chat-tools": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]}],
                                                   "tools": [TOOL], "tool_choice": "auto", "stream": True, "stream_options": {"include_usage": True},
                                                   "temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}),
    "openai-chat-schema": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "developer", "content": "json"}, {"role": "user", "content": "a person"}],
                                                    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
                                                    "n": 1, "seed": 3, "stop": "x", "reasoning_effort": "low"}),
    "openai-completions": ("/v1/completions", {"model": MODEL, "prompt": ["once upon", "a time"], "max_tokens": 4,
                                               "logit_bias": {"15": -100}, "presence_penalty": 0.5, "frequency_penalty": 0.2}),
    "openai-embeddings": ("/v1/embeddings", {"model": MODEL, "input": [[1, 2, 3], "text"], "encoding_format": "base64"}),
}

directory = pathlib.Path(__file__).parent / "corpus" / "server_bodies"
directory.mkdir(parents=True, exist_ok=True)
for name, (endpoint, body) in SEEDS.items():
    (directory / name).write_bytes(bytes([ENDPOINTS.index(endpoint)]) + json.dumps(body).encode())
