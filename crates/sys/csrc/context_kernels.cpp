// Batch-invariant kernels for a llama.cpp context: ggml's CPU backend can run its reference
// implementation (one dot product per output element: no llamafile tiles, no tiled or
// split-KV flash attention, no op fusion), whose result for a token's row does not depend on
// what else is in the batch. llama.cpp does not expose a context's backends, so this reaches
// them through the context's scheduler (llama_context::get_sched, a public member of the
// pinned source) and sets the option through the CPU registry's proc address, which works for
// static builds and for CPU backends loaded as libraries alike.
#include "llama-context.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

extern "C" int hypura_context_set_reference_kernels(struct llama_context * ctx, bool use_ref) {
    if (ctx == nullptr) {
        return -1;
    }
    ggml_backend_sched_t sched = ctx->get_sched();
    if (sched == nullptr) {
        return -1;
    }
    int changed = 0;
    const int n_backends = ggml_backend_sched_get_n_backends(sched);
    for (int i = 0; i < n_backends; i++) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        if (dev == nullptr || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            continue;
        }
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        auto * set_use_ref = (decltype(ggml_backend_cpu_set_use_ref) *) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_set_use_ref");
        if (set_use_ref == nullptr) {
            continue;
        }
        set_use_ref(backend, use_ref);
        changed++;
    }
    return changed;
}

// The context's backends (its scheduler's), at most `max` of them into `out`; the count, or -1.
// The eval hook writes the router's rewritten ids through the backend that computes them, in
// that backend's own queue (ggml_backend_tensor_set_async), instead of a copy it waits for.
extern "C" int hypura_context_backends(struct llama_context * ctx, ggml_backend_t * out, int max) {
    if (ctx == nullptr || out == nullptr || max < 0) {
        return -1;
    }
    ggml_backend_sched_t sched = ctx->get_sched();
    if (sched == nullptr) {
        return -1;
    }
    const int n_backends = ggml_backend_sched_get_n_backends(sched);
    int count = 0;
    for (int i = 0; i < n_backends && count < max; i++) {
        out[count++] = ggml_backend_sched_get_backend(sched, i);
    }
    return count;
}
