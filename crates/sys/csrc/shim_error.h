// What the C++ shims share: a C++ exception must never cross into Rust, so every entry point
// runs its body through `hypura_guarded`, which turns any exception into a message stored in
// `*error` (malloc'd; the caller frees it with hypura_chat_string_free) and a failure result.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

// A malloc'd, NUL-terminated copy of `text` (null when out of memory).
static inline char * hypura_copy_string(const std::string & text) {
    char * out = (char *) std::malloc(text.size() + 1);
    if (out != nullptr) {
        std::memcpy(out, text.c_str(), text.size() + 1);
    }
    return out;
}

static inline void hypura_set_error(char ** error, const std::string & message) {
    if (error != nullptr) {
        *error = hypura_copy_string(message);
    }
}

// Run `body`; on an exception store its message (or `what_failed`'s) and return `failed`.
template <typename R, typename F>
static R hypura_guarded(char ** error, const char * what_failed, R failed, F && body) {
    try {
        return body();
    } catch (const std::exception & e) {
        hypura_set_error(error, e.what());
    } catch (...) {
        hypura_set_error(error, std::string("unknown error in ") + what_failed);
    }
    return failed;
}
