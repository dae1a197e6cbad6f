"""LangChain's standard integration tests for chat models (`langchain-tests`), against a server.

    HYPURA_LC_BASE=http://127.0.0.1:PORT HYPURA_LC_MODEL=NAME pytest langchain_standard.py

`TestChatOllama` drives the server's Ollama API through `langchain-ollama`, `TestChatOpenAI`
its OpenAI API (`/v1`) through `langchain-openai`. `HYPURA_LC_APIS=openai` runs the second
alone, for a server that has no Ollama API (llama-server). Greedy, and answers bounded at 256
tokens, so that a looping answer costs seconds and both servers get the same requests.
"""
import os

from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

BASE = os.environ["HYPURA_LC_BASE"].rstrip("/")
MODEL = os.environ["HYPURA_LC_MODEL"]
APIS = os.environ.get("HYPURA_LC_APIS", "ollama,openai").split(",")
MAX_TOKENS = int(os.environ.get("HYPURA_LC_MAX_TOKENS", "256"))


class Shared:
    """What both APIs offer: tools, a named tool_choice, JSON mode, structured output, usage
    figures; no images, audio or PDFs (the test models read text alone)."""

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False


if "ollama" in APIS:

    class TestChatOllama(Shared, ChatModelIntegrationTests):
        @property
        def chat_model_class(self):
            return ChatOllama

        @property
        def has_tool_choice(self) -> bool:
            # Ollama's API has no tool_choice; ChatOllama accepts the argument and drops it.
            return False

        @property
        def chat_model_params(self) -> dict:
            return {"model": MODEL, "base_url": BASE, "temperature": 0, "num_predict": MAX_TOKENS}


if "openai" in APIS:

    class TestChatOpenAI(Shared, ChatModelIntegrationTests):
        @property
        def chat_model_class(self):
            return ChatOpenAI

        @property
        def chat_model_params(self) -> dict:
            return {
                "model": MODEL,
                "base_url": BASE + "/v1",
                "api_key": os.environ.get("HYPURA_LC_API_KEY", "none"),
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
                "timeout": 120,
                "stream_usage": True,
            }
