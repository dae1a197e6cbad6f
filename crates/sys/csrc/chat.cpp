// llama.cpp's chat layer (common/chat.h) behind a C interface of JSON strings: the model's Jinja
// template rendered with messages, tools and the thinking switch; the grammar (lazy, with its
// triggers) that keeps a tool call well formed; and the parser that turns the model's output
// back into content, reasoning and tool calls, for every format llama.cpp knows (Hermes/Qwen,
// Llama 3.x, Mistral, gpt-oss, DeepSeek, GLM, Qwen3.5 and the templates its autoparser reads);
// and the same layer's JSON-schema-to-grammar converter (common/json-schema-to-grammar.h), for
// structured output.
//
// Every entry point catches every exception (`shim_error.h`): on failure the function returns
// null and, when `error` is not null, stores a message there that the caller frees with
// hypura_chat_string_free.
#include "chat.h"
#include "common.h"
#include "json-schema-to-grammar.h"
#include "json.h"
#include "shim_error.h"

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <regex>
#include <string>

struct hypura_chat {
    common_chat_templates_ptr templates;
};

struct hypura_chat_result {
    common_chat_params params;
    common_chat_parser_params parser;
};

static char * copy_string(const std::string & text) {
    return hypura_copy_string(text);
}

// Run `body`, turning any exception into an error string and a null result.
template <typename T, typename F>
static T * guarded(char ** error, F && body) {
    return hypura_guarded<T *>(error, "llama.cpp's chat layer", nullptr, body);
}

extern "C" void hypura_chat_string_free(char * text) {
    std::free(text);
}

extern "C" hypura_chat * hypura_chat_init(const struct llama_model * model, const char * template_override, char ** error) {
    return guarded<hypura_chat>(error, [&]() {
        auto chat = std::make_unique<hypura_chat>();
        chat->templates = common_chat_templates_init(model, template_override != nullptr ? template_override : "");
        return chat.release();
    });
}

extern "C" void hypura_chat_free(hypura_chat * chat) {
    delete chat;
}

// {"explicit": the file (or the override) has a template, "tools": it renders tools,
//  "thinking": it has a reasoning section, "caps": the Jinja capability flags}
extern "C" char * hypura_chat_describe(const hypura_chat * chat, char ** error) {
    return guarded<char>(error, [&]() {
        common_json caps = common_json::object();
        bool tools = false;
        for (const auto & [key, value] : common_chat_templates_get_caps(chat->templates.get())) {
            caps[key] = value;
            if (key == "supports_tools" || key == "supports_tool_calls") {
                tools = tools || value;
            }
        }
        common_json out = common_json::object();
        out["explicit"] = common_chat_templates_was_explicit(chat->templates.get());
        out["tools"] = tools;
        out["thinking"] = common_chat_templates_support_enable_thinking(chat->templates.get());
        out["caps"] = caps;
        return copy_string(out.dump());
    });
}

static common_reasoning_format reasoning_format_of(const common_json & request) {
    return common_reasoning_format_from_name(request.value("reasoning_format", "deepseek"));
}

// request: {"messages": [OpenAI messages], "tools": [OpenAI tools] (optional), "tool_choice":
// "auto" | "required" | "none", "parallel_tool_calls": bool, "enable_thinking": bool,
// "reasoning_format": "deepseek" | "none", "add_generation_prompt": bool,
// "chat_template_kwargs": {name: JSON text}}
extern "C" hypura_chat_result * hypura_chat_apply(const hypura_chat * chat, const char * request_json, char ** error) {
    return guarded<hypura_chat_result>(error, [&]() {
        const common_json request = common_json::parse(request_json);
        common_chat_templates_inputs inputs;
        inputs.messages = common_chat_msgs_parse_oaicompat(request.at("messages"));
        if (request.contains("tools") && request.at("tools").is_array() && !request.at("tools").empty()) {
            inputs.tools = common_chat_tools_parse_oaicompat(request.at("tools"));
        }
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(request.value("tool_choice", "auto"));
        inputs.parallel_tool_calls = request.value("parallel_tool_calls", false);
        inputs.enable_thinking = request.value("enable_thinking", true);
        inputs.reasoning_format = reasoning_format_of(request);
        inputs.add_generation_prompt = request.value("add_generation_prompt", true);
        inputs.use_jinja = true;
        if (request.contains("chat_template_kwargs")) {
            for (auto it = request.at("chat_template_kwargs").begin(); it != request.at("chat_template_kwargs").end(); ++it) {
                inputs.chat_template_kwargs[it.key()] = it.value().dump();
            }
        }
        auto result = std::make_unique<hypura_chat_result>();
        result->params = common_chat_templates_apply(chat->templates.get(), inputs);
        result->parser = common_chat_parser_params(result->params);
        result->parser.reasoning_format = inputs.reasoning_format;
        result->parser.parse_tool_calls = !inputs.tools.empty() && inputs.tool_choice != COMMON_CHAT_TOOL_CHOICE_NONE;
        if (!result->params.parser.empty()) {
            result->parser.parser.load(result->params.parser);
        }
        return result.release();
    });
}

extern "C" void hypura_chat_result_free(hypura_chat_result * result) {
    delete result;
}

// The lazy grammar's triggers as llama.cpp's own sampler setup writes them: words and
// full-match patterns become regular expressions, token triggers stay token ids.
static void trigger_lists(const common_chat_params & params, std::vector<std::string> & patterns, std::vector<llama_token> & tokens) {
    for (const auto & trigger : params.grammar_triggers) {
        switch (trigger.type) {
            case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:
                patterns.push_back(regex_escape(trigger.value));
                break;
            case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:
                patterns.push_back(trigger.value);
                break;
            case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: {
                const std::string & pattern = trigger.value;
                std::string anchored = "^$";
                if (!pattern.empty()) {
                    anchored = (pattern.front() != '^' ? "^" : "") + pattern + (pattern.back() != '$' ? "$" : "");
                }
                patterns.push_back(anchored);
                break;
            }
            case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:
                tokens.push_back(trigger.token);
                break;
        }
    }
}

// {"prompt", "grammar", "grammar_lazy", "preserved_tokens": [text], "additional_stops": [text],
//  "generation_prompt", "supports_thinking", "format"}
extern "C" char * hypura_chat_result_json(const hypura_chat_result * result, char ** error) {
    return guarded<char>(error, [&]() {
        const common_chat_params & params = result->params;
        common_json out = common_json::object();
        out["prompt"] = params.prompt;
        out["grammar"] = params.grammar;
        out["grammar_lazy"] = params.grammar_lazy;
        out["preserved_tokens"] = params.preserved_tokens;
        out["additional_stops"] = params.additional_stops;
        out["generation_prompt"] = params.generation_prompt;
        out["supports_thinking"] = params.supports_thinking;
        out["format"] = common_chat_format_name(params.format);
        return copy_string(out.dump());
    });
}

// The grammar sampler for the rendered request, built as llama.cpp's common_sampler_init builds
// it: lazy with its triggers, or (tool_choice "required") strict and advanced past the
// generation prompt the template already wrote. Null with *none set when there is no grammar.
extern "C" struct llama_sampler * hypura_chat_result_grammar(const hypura_chat_result * result, const struct llama_vocab * vocab, bool * none, char ** error) {
    *none = result->params.grammar.empty();
    if (*none) {
        return nullptr;
    }
    return guarded<llama_sampler>(error, [&]() -> llama_sampler * {
        const common_chat_params & params = result->params;
        std::vector<std::string> patterns;
        std::vector<llama_token> tokens;
        trigger_lists(params, patterns, tokens);
        std::vector<const char *> pattern_pointers;
        for (const auto & pattern : patterns) {
            // llama.cpp compiles these with std::regex outside any try: compile them here
            // first, where an exception becomes an error.
            std::regex compiled(pattern);
            (void) compiled;
            pattern_pointers.push_back(pattern.c_str());
        }
        llama_sampler * grammar = params.grammar_lazy
            ? llama_sampler_init_grammar_lazy_patterns(vocab, params.grammar.c_str(), "root", pattern_pointers.data(), pattern_pointers.size(), tokens.data(), tokens.size())
            : llama_sampler_init_grammar(vocab, params.grammar.c_str(), "root");
        if (grammar == nullptr) {
            throw std::runtime_error("llama.cpp could not parse the tool-call grammar");
        }
        if (!params.grammar_lazy && !params.generation_prompt.empty()) {
            const auto prefill = common_tokenize(vocab, params.generation_prompt, false, true);
            try {
                for (size_t i = 0; i < prefill.size(); i++) {
                    const std::string piece = common_token_to_piece(vocab, prefill[i], true);
                    // Some tokenizers put a space before the first special token.
                    if (i == 0 && !piece.empty() && std::isspace((unsigned char) piece[0]) && !std::isspace((unsigned char) params.generation_prompt[0])) {
                        continue;
                    }
                    llama_sampler_accept(grammar, prefill[i]);
                }
            } catch (...) {
                llama_sampler_free(grammar);
                throw;
            }
        }
        return grammar;
    });
}

// The assistant message in `text` (what the model generated), as OpenAI's JSON: "content",
// "reasoning_content" and "tool_calls" ({"type": "function", "function": {"name", "arguments"},
// "id"}). `partial`: the output may still grow (streaming), so an unfinished call is not an error.
extern "C" char * hypura_chat_parse(const hypura_chat_result * result, const char * text, bool partial, char ** error) {
    return guarded<char>(error, [&]() {
        common_chat_msg message = common_chat_parse(text, partial, result->parser);
        return copy_string(message.to_json_oaicompat().dump());
    });
}

// The GBNF grammar (root rule `root`) for a JSON schema given as UTF-8 JSON text, by llama.cpp's
// converter; always GBNF, even in a build with llguidance. Text that is not JSON and schemas the
// converter refuses (an unknown type, a $ref it cannot resolve, an invalid pattern) are errors.
// The converter recurses over the schema: the caller bounds its size and runs this on a stack
// sized for those bounds.
extern "C" char * hypura_json_schema_to_grammar(const char * schema_json, char ** error) {
    return hypura_guarded<char *>(error, "llama.cpp's JSON schema converter", nullptr, [&]() {
        return copy_string(json_schema_to_grammar(common_json::parse(schema_json), /* force_gbnf= */ true));
    });
}
