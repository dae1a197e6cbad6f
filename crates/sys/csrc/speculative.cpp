// llama.cpp's speculative decoding (common/speculative.h) behind a C interface: the drafters
// (a draft model, the prompt-lookup n-gram drafters) propose tokens for each sequence, and the
// caller verifies them with one decode of the target. The caller owns both contexts and the
// verification; this shim keeps the drafters' state in step with what the target decoded.
//
// The draft model's KV cache follows the target's: every batch the target decoded is fed to the
// draft context (`process`), after dropping the draft's cells at and after each sequence's first
// position in that batch, and a draft drops the cells from its first token's position on. That
// one rule keeps the two caches holding the same tokens whatever the target did in between
// (rejected drafts removed, a prefix reused, a sequence restarted): the target's next batch for
// a sequence, and its next draft, always start where its valid cache ends.
//
// Every entry point catches every exception (`shim_error.h`): on failure the function returns
// null or false and, when `error` is not null, stores a message there that the caller frees with
// hypura_chat_string_free (the chat shim's allocator).
#include "common.h"
#include "speculative.h"
#include "shim_error.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

struct hypura_spec {
    common_params_speculative params;
    common_speculative * spec = nullptr;
    // the target context is read only inside init (the vocabularies' check); the draft
    // context is decoded by every call
    llama_context * ctx_dft = nullptr;
    common_batch batch;
    // per sequence: the history handed to the drafter and the draft it returned
    std::vector<llama_tokens> history;
    std::vector<llama_tokens> drafts;
    // per sequence: whether the last draft call produced tokens not yet accepted
    std::vector<bool> pending;
    // the MTP drafter starts a sequence once the target has decoded its prompt (its layer
    // follows the target's hidden states, which `process` hands it batch by batch); then every
    // drafter starts at the sequence's first draft, with the tokens decoded so far
    bool begin_at_first_draft = false;
    std::vector<bool> begun;

    ~hypura_spec() {
        if (spec != nullptr) {
            common_speculative_free(spec);
        }
    }
};

template <typename F>
static bool spec_guarded(char ** error, F && body) {
    return hypura_guarded<bool>(error, "llama.cpp's speculative decoding", false, body);
}

// types: comma-separated llama.cpp names ("draft-simple", "draft-mtp", "ngram-simple",
// "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"); ctx_dft is the draft model's
// context, or for draft-mtp an MTP context of the target's model, and may be null when no type
// needs one.
extern "C" hypura_spec * hypura_spec_init(
        llama_context * ctx_tgt, llama_context * ctx_dft, const char * types, int32_t n_seq,
        int32_t n_max, int32_t n_min, float p_min, int32_t ngram_n, char ** error) {
    hypura_spec * result = nullptr;
    spec_guarded(error, [&]() {
        if (ctx_tgt == nullptr || types == nullptr || n_seq <= 0 || n_max <= 0 || n_min < 0 || n_min > n_max || ngram_n <= 0 || ngram_n > 1024) {
            throw std::invalid_argument("invalid speculative decoding arguments");
        }
        auto spec = std::make_unique<hypura_spec>();
        std::vector<std::string> names;
        std::string list(types);
        size_t start = 0;
        while (start <= list.size()) {
            const size_t comma = list.find(',', start);
            const size_t end = comma == std::string::npos ? list.size() : comma;
            if (end > start) {
                names.push_back(list.substr(start, end - start));
            }
            if (comma == std::string::npos) {
                break;
            }
            start = comma + 1;
        }
        spec->params.types = common_speculative_types_from_names(names);
        for (const auto type : spec->params.types) {
            // draft-mtp drafts with the target model's own MTP layers, in a context of its own
            const bool needs_model = type == COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE || type == COMMON_SPECULATIVE_TYPE_DRAFT_MTP;
            const bool supported = needs_model || type == COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE ||
                                   type == COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K || type == COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K4V ||
                                   type == COMMON_SPECULATIVE_TYPE_NGRAM_MOD || type == COMMON_SPECULATIVE_TYPE_NGRAM_CACHE;
            if (!supported) {
                throw std::invalid_argument("speculative type '" + common_speculative_type_to_str(type) + "' is not supported here");
            }
            if (needs_model && ctx_dft == nullptr) {
                throw std::invalid_argument("speculative type '" + common_speculative_type_to_str(type) + "' needs a draft context");
            }
        }
        spec->params.draft.ctx_tgt = ctx_tgt;
        spec->params.draft.ctx_dft = ctx_dft;
        spec->params.draft.n_max = n_max;
        spec->params.draft.n_min = n_min;
        spec->params.draft.p_min = p_min;
        // the n-gram drafters match the last ngram_n tokens and propose at most n_max
        spec->params.ngram_simple.size_n = (uint16_t) ngram_n;
        spec->params.ngram_map_k.size_n = (uint16_t) ngram_n;
        spec->params.ngram_map_k4v.size_n = (uint16_t) ngram_n;
        spec->params.ngram_mod.n_match = ngram_n;
        spec->params.ngram_simple.size_m = (uint16_t) std::min<int32_t>(spec->params.ngram_simple.size_m, n_max);
        spec->params.ngram_map_k.size_m = (uint16_t) std::min<int32_t>(spec->params.ngram_map_k.size_m, n_max);
        spec->params.ngram_map_k4v.size_m = (uint16_t) std::min<int32_t>(spec->params.ngram_map_k4v.size_m, n_max);
        spec->params.ngram_mod.n_max = std::min(spec->params.ngram_mod.n_max, n_max);
        spec->params.ngram_mod.n_min = std::min(spec->params.ngram_mod.n_min, n_max);
        spec->ctx_dft = ctx_dft;
        // a token list for the drafters; only a draft context ever decodes it
        spec->batch = common_batch(ctx_dft != nullptr ? ctx_dft : ctx_tgt);
        spec->history.resize(n_seq);
        spec->drafts.resize(n_seq);
        spec->pending.assign(n_seq, false);
        spec->begun.assign(n_seq, false);
        spec->begin_at_first_draft = std::find(spec->params.types.begin(), spec->params.types.end(), COMMON_SPECULATIVE_TYPE_DRAFT_MTP) != spec->params.types.end();
        spec->spec = common_speculative_init(spec->params, (uint32_t) n_seq);
        if (spec->spec == nullptr) {
            throw std::runtime_error("llama.cpp initialized no speculative implementation");
        }
        result = spec.release();
        return true;
    });
    return result;
}

extern "C" void hypura_spec_free(hypura_spec * spec) {
    delete spec;
}

// A new generation in sequence `seq` with these prompt tokens.
extern "C" bool hypura_spec_begin(hypura_spec * spec, int32_t seq, const llama_token * prompt, size_t n_prompt, char ** error) {
    return spec_guarded(error, [&]() {
        if (seq < 0 || (size_t) seq >= spec->history.size() || (prompt == nullptr && n_prompt > 0)) {
            throw std::invalid_argument("invalid speculative begin arguments");
        }
        spec->history[seq].assign(prompt, prompt + n_prompt);
        spec->pending[seq] = false;
        spec->begun[seq] = !spec->begin_at_first_draft;
        if (spec->begun[seq]) {
            common_speculative_begin(spec->spec, seq, spec->history[seq]);
        }
        return true;
    });
}

// The target decoded this batch (one sequence id per token): the drafters follow.
extern "C" bool hypura_spec_process(hypura_spec * spec, const llama_batch * decoded, char ** error) {
    return spec_guarded(error, [&]() {
        if (decoded == nullptr || decoded->n_tokens <= 0) {
            return true;
        }
        if (decoded->token == nullptr || decoded->pos == nullptr || decoded->n_seq_id == nullptr || decoded->seq_id == nullptr) {
            throw std::invalid_argument("a speculative batch must carry tokens, positions and sequence ids");
        }
        const size_t n_seq = spec->history.size();
        std::vector<llama_pos> first(n_seq, -1);
        for (int32_t i = 0; i < decoded->n_tokens; ++i) {
            const llama_seq_id seq = decoded->n_seq_id[i] == 1 ? decoded->seq_id[i][0] : -1;
            if (seq < 0 || (size_t) seq >= n_seq) {
                throw std::invalid_argument("a speculative batch names a sequence out of range");
            }
            if (first[seq] < 0 || decoded->pos[i] < first[seq]) {
                first[seq] = decoded->pos[i];
            }
        }
        if (spec->ctx_dft != nullptr) {
            auto * memory = llama_get_memory(spec->ctx_dft);
            for (size_t seq = 0; seq < n_seq; ++seq) {
                if (first[seq] >= 0 && !llama_memory_seq_rm(memory, (llama_seq_id) seq, first[seq], -1)) {
                    // a cache that cannot drop a tail (sliding window) drops the sequence; the
                    // drafts get worse, never wrong (the target verifies every one)
                    llama_memory_seq_rm(memory, (llama_seq_id) seq, -1, -1);
                }
            }
        }
        spec->batch.clear();
        for (int32_t i = 0; i < decoded->n_tokens; ++i) {
            spec->batch.add(decoded->token[i], decoded->pos[i], decoded->seq_id[i][0], false);
        }
        if (!common_speculative_process(spec->spec, spec->batch)) {
            throw std::runtime_error("the draft context failed to decode a batch");
        }
        return true;
    });
}

// One draft request: the sequence, the most tokens to propose, the position of `last` (the
// sampled token not yet decoded) and the sequence's tokens before it.
struct hypura_spec_request {
    int32_t seq;
    int32_t n_max;
    llama_pos pos_last;
    llama_token last;
    const llama_token * history;
    size_t n_history;
};

// Drafts for several sequences at once (a draft model decodes them in one batch). Sequence k's
// draft goes to out[k * stride ...] with its length in counts[k].
extern "C" bool hypura_spec_draft(
        hypura_spec * spec, const hypura_spec_request * requests, size_t n_requests, llama_token * out, size_t stride,
        int32_t * counts, char ** error) {
    return spec_guarded(error, [&]() {
        const size_t n_seq = spec->history.size();
        for (size_t k = 0; k < n_requests; ++k) {
            const auto & request = requests[k];
            if (request.seq < 0 || (size_t) request.seq >= n_seq || request.n_max <= 0 || (size_t) request.n_max > stride ||
                (request.history == nullptr && request.n_history > 0) || spec->pending[request.seq]) {
                throw std::invalid_argument("invalid speculative draft request");
            }
            // the draft model decodes `last` at its position: its cells from there on held the
            // previous pass's rejected tokens
            if (spec->ctx_dft != nullptr) {
                llama_memory_seq_rm(llama_get_memory(spec->ctx_dft), request.seq, request.pos_last, -1);
            }
            spec->history[request.seq].assign(request.history, request.history + request.n_history);
            if (!spec->begun[request.seq]) {
                common_speculative_begin(spec->spec, request.seq, spec->history[request.seq]);
                spec->begun[request.seq] = true;
            }
            spec->drafts[request.seq].clear();
            auto & params = common_speculative_get_draft_params(spec->spec, request.seq);
            params.drafting = true;
            params.n_max = request.n_max;
            params.pos0 = request.pos_last;
            params.id_last = request.last;
            params.prompt = &spec->history[request.seq];
            params.result = &spec->drafts[request.seq];
            params.result_q = nullptr;
        }
        common_speculative_draft(spec->spec);
        for (size_t k = 0; k < n_requests; ++k) {
            const auto & request = requests[k];
            auto & draft = spec->drafts[request.seq];
            if (draft.size() > (size_t) request.n_max) {
                draft.resize(request.n_max);
            }
            std::memcpy(out + k * stride, draft.data(), draft.size() * sizeof(llama_token));
            counts[k] = (int32_t) draft.size();
            spec->pending[request.seq] = !draft.empty();
        }
        return true;
    });
}

// How many tokens of sequence `seq`'s last draft the target accepted.
extern "C" bool hypura_spec_accept(hypura_spec * spec, int32_t seq, uint16_t n_accepted, char ** error) {
    return spec_guarded(error, [&]() {
        if (seq < 0 || (size_t) seq >= spec->history.size() || !spec->pending[seq] || n_accepted > spec->drafts[seq].size()) {
            throw std::invalid_argument("invalid speculative accept arguments");
        }
        common_speculative_accept(spec->spec, seq, n_accepted);
        spec->pending[seq] = false;
        return true;
    });
}

// Whether the draft model's vocabulary matches the target's (llama.cpp's own check).
extern "C" bool hypura_spec_compatible(const llama_model * target, const llama_model * draft) {
    try {
        return common_speculative_are_compatible(target, draft);
    } catch (...) {
        return false;
    }
}
