// Routed experts computed by ggml's CPU backend, beside a device that computes the others: the
// split of a pooled MoE layer (the picks no device slot holds are computed here, from the
// host's expert cache). Each job is one token's one expert, SwiGLU as llama.cpp's MoE FFN
// computes it (`build_moe_ffn` with separate gate and up experts, no biases or scales), over a
// part of the FFN's width: rows [ff_start, ff_start + ff_len) of gate and up, the same columns
// of down (whole blocks of down's type), so that the parts of one expert sum to the expert:
//
//     out[token] += weight * down[:, part](silu(gate[part] . x[token]) * (up[part] . x[token]))
//
// The expert slices are the file's bytes where they lie in host memory; ggml's own kernels
// (mul_mat, swiglu, scale, add) compute them through a CPU backend of the caller's, so the CPU's
// share is computed as the CPU backend computes a resident layer.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <stdint.h>
#include <stdlib.h>

struct hypura_expert_job {
    const void * gate;
    const void * up;
    const void * down;
    int32_t token;
    float weight;
    int64_t ff_start;
    int64_t ff_len;
};

// 0 on success; -1 bad arguments, -2 no memory, -3 the backend failed.
int hypura_expert_ffn(
        ggml_backend_t cpu,
        int32_t gate_type,
        int32_t up_type,
        int32_t down_type,
        int64_t n_embd,
        int64_t n_ff,
        const float * x,
        int64_t n_tokens,
        const struct hypura_expert_job * jobs,
        int32_t n_jobs,
        float * out) {
    if (cpu == NULL || x == NULL || jobs == NULL || out == NULL || n_jobs <= 0 || n_tokens <= 0 || n_embd <= 0 || n_ff <= 0) {
        return -1;
    }
    const int64_t down_block = ggml_blck_size((enum ggml_type) down_type);
    for (int32_t j = 0; j < n_jobs; j++) {
        const int64_t start = jobs[j].ff_start, len = jobs[j].ff_len;
        if (jobs[j].token < 0 || jobs[j].token >= n_tokens || !jobs[j].gate || !jobs[j].up || !jobs[j].down ||
            start < 0 || len <= 0 || start + len > n_ff || start % down_block != 0 || len % down_block != 0) {
            return -1;
        }
    }
    // Weights: three tensors a job, over the slices' own memory. Compute: the input, four views
    // and five nodes a job, a sum a token.
    const size_t n_weights = 3 * (size_t) n_jobs;
    const size_t n_nodes = 1 + 9 * (size_t) n_jobs + 2 * (size_t) n_tokens;
    const size_t graph_size = n_nodes + 16;
    struct ggml_init_params weight_params = { ggml_tensor_overhead() * n_weights, NULL, true };
    struct ggml_init_params compute_params = {
        ggml_tensor_overhead() * (n_nodes + 16) + ggml_graph_overhead_custom(graph_size, false), NULL, true };
    struct ggml_context * weights = ggml_init(weight_params);
    struct ggml_context * ctx = ggml_init(compute_params);
    ggml_backend_buffer_t slices = NULL;
    ggml_backend_buffer_t buffer = NULL;
    struct ggml_tensor ** sums = NULL;
    int status = 0;
    if (weights == NULL || ctx == NULL) {
        status = -2;
        goto done;
    }
    {
        // One host buffer spanning every slice (nothing is allocated: it only names the memory).
        const size_t gate_bytes = ggml_row_size((enum ggml_type) gate_type, n_embd) * n_ff;
        const size_t up_bytes = ggml_row_size((enum ggml_type) up_type, n_embd) * n_ff;
        const size_t down_bytes = ggml_row_size((enum ggml_type) down_type, n_ff) * n_embd;
        uintptr_t low = UINTPTR_MAX, high = 0;
        for (int32_t j = 0; j < n_jobs; j++) {
            const uintptr_t starts[3] = { (uintptr_t) jobs[j].gate, (uintptr_t) jobs[j].up, (uintptr_t) jobs[j].down };
            const size_t sizes[3] = { gate_bytes, up_bytes, down_bytes };
            for (int k = 0; k < 3; k++) {
                if (starts[k] < low) low = starts[k];
                if (starts[k] + sizes[k] > high) high = starts[k] + sizes[k];
            }
        }
        low &= ~(uintptr_t) 63; // ggml wants a buffer's base aligned; the bytes before are never read
        slices = ggml_backend_cpu_buffer_from_ptr((void *) low, high - low);
        if (slices == NULL) {
            status = -2;
            goto done;
        }
        struct ggml_tensor * input = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, n_tokens);
        sums = calloc((size_t) n_tokens, sizeof(struct ggml_tensor *));
        if (sums == NULL) {
            status = -2;
            goto done;
        }
        for (int32_t j = 0; j < n_jobs; j++) {
            struct ggml_tensor * gate = ggml_new_tensor_2d(weights, (enum ggml_type) gate_type, n_embd, n_ff);
            struct ggml_tensor * up = ggml_new_tensor_2d(weights, (enum ggml_type) up_type, n_embd, n_ff);
            struct ggml_tensor * down = ggml_new_tensor_2d(weights, (enum ggml_type) down_type, n_ff, n_embd);
            if (ggml_backend_tensor_alloc(slices, gate, (void *) jobs[j].gate) != GGML_STATUS_SUCCESS ||
                ggml_backend_tensor_alloc(slices, up, (void *) jobs[j].up) != GGML_STATUS_SUCCESS ||
                ggml_backend_tensor_alloc(slices, down, (void *) jobs[j].down) != GGML_STATUS_SUCCESS) {
                status = -1;
                goto done;
            }
            const int32_t token = jobs[j].token;
            const int64_t start = jobs[j].ff_start, len = jobs[j].ff_len;
            struct ggml_tensor * row = ggml_view_1d(ctx, input, n_embd, (size_t) token * input->nb[1]);
            // The part's rows of gate and up, and its columns of down (rows of down strided).
            struct ggml_tensor * gate_part = ggml_view_2d(ctx, gate, n_embd, len, gate->nb[1], (size_t) start * gate->nb[1]);
            struct ggml_tensor * up_part = ggml_view_2d(ctx, up, n_embd, len, up->nb[1], (size_t) start * up->nb[1]);
            struct ggml_tensor * down_part =
                ggml_view_2d(ctx, down, len, n_embd, down->nb[1], ggml_row_size((enum ggml_type) down_type, start));
            struct ggml_tensor * hidden =
                ggml_swiglu_split(ctx, ggml_mul_mat(ctx, gate_part, row), ggml_mul_mat(ctx, up_part, row));
            struct ggml_tensor * result = ggml_scale(ctx, ggml_mul_mat(ctx, down_part, hidden), jobs[j].weight);
            sums[token] = sums[token] == NULL ? result : ggml_add(ctx, sums[token], result);
        }
        struct ggml_cgraph * graph = ggml_new_graph_custom(ctx, graph_size, false);
        for (int64_t t = 0; t < n_tokens; t++) {
            if (sums[t] != NULL) {
                ggml_build_forward_expand(graph, sums[t]);
            }
        }
        buffer = ggml_backend_alloc_ctx_tensors(ctx, cpu);
        if (buffer == NULL) {
            status = -2;
            goto done;
        }
        ggml_backend_tensor_set(input, x, 0, sizeof(float) * (size_t) (n_embd * n_tokens));
        if (ggml_backend_graph_compute(cpu, graph) != GGML_STATUS_SUCCESS) {
            status = -3;
            goto done;
        }
        for (int64_t t = 0; t < n_tokens; t++) {
            if (sums[t] == NULL) {
                continue;
            }
            const float * sum = (const float *) sums[t]->data;
            float * target = out + t * n_embd;
            for (int64_t i = 0; i < n_embd; i++) {
                target[i] += sum[i];
            }
        }
    }
done:
    free(sums);
    if (buffer != NULL) ggml_backend_buffer_free(buffer);
    if (slices != NULL) ggml_backend_buffer_free(slices);
    if (ctx != NULL) ggml_free(ctx);
    if (weights != NULL) ggml_free(weights);
    return status;
}

// Set a CPU backend's threads through its registry (the CPU backend may be a library loaded at
// run time, whose own functions are not linked): 0 on success, -1 where it has no such setter.
int hypura_backend_set_threads(ggml_backend_t backend, int n_threads) {
    if (backend == NULL || n_threads <= 0) {
        return -1;
    }
    ggml_backend_dev_t device = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = device ? ggml_backend_dev_backend_reg(device) : NULL;
    ggml_backend_set_n_threads_t set = reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") : NULL;
    if (set == NULL) {
        return -1;
    }
    set(backend, n_threads);
    return 0;
}
