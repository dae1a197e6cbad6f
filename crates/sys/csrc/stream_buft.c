// Hypura's stream buffer type: a ggml host buffer type whose tensors are not filled at load.
//
// The buffer is one reservation the size of the model file (made and owned by Hypura's store), and each
// tensor's data lives at `base + its file offset`, so the region mirrors the file: an aligned
// direct read of any file range lands in place. Pages are physically backed only once Hypura's
// store reads into them, and released with MADV_DONTNEED. set_tensor/memset/clear do nothing:
// llama.cpp's loader never fills these tensors; the store does, on demand.
//
// During the load, llama.cpp still copies placeholder bytes into every host tensor. So until
// `hypura_stream_buft_finalize`, tensors point at a small "sink" that absorbs those copies
// (faulted in once, reused by every tensor) instead of faulting in the whole region; finalize
// then points each tensor at its mirror address, once, before any graph runs.
//
// The type remembers its tensors (`hypura_stream_buft_tensor` finds one by name), so that the
// store can place a streamed expert tensor in a device's expert pool after the load.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend-impl.h"
#include "ggml-backend.h"

typedef int64_t (*hypura_offset_fn)(void * user, const char * name);

struct hypura_tensor_record {
    struct ggml_tensor * tensor;
    int64_t offset;
};

struct hypura_stream_buft_context {
    struct ggml_backend_buffer_type buft;
    void * base;
    size_t size;
    hypura_offset_fn offset_of;
    void * user;
    void * sink;
    size_t sink_size;
    struct hypura_tensor_record * records;
    size_t n_records;
    size_t records_capacity;
    bool finalized;
};

static const char * hypura_buft_get_name(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return "Hypura_Stream";
}

static void * hypura_buffer_get_base(ggml_backend_buffer_t buffer) {
    struct hypura_stream_buft_context * ctx = (struct hypura_stream_buft_context *) buffer->context;
    return ctx->base;
}

static enum ggml_status hypura_buffer_init_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor) {
    struct hypura_stream_buft_context * ctx = (struct hypura_stream_buft_context *) buffer->context;
    if (tensor->view_src != NULL) {
        return GGML_STATUS_SUCCESS;  // views share their source's data
    }
    int64_t offset = ctx->offset_of(ctx->user, tensor->name);
    if (offset < 0 || (uint64_t) offset + ggml_nbytes(tensor) > ctx->size) {
        return GGML_STATUS_FAILED;
    }
    // Before finalize, a sink absorbs the loader's copies: the tensor must fit it.
    bool sinking = ctx->sink != NULL && !ctx->finalized;
    if (sinking && ggml_nbytes(tensor) > ctx->sink_size) {
        return GGML_STATUS_FAILED;
    }
    if (ctx->n_records == ctx->records_capacity) {
        size_t capacity = ctx->records_capacity ? 2 * ctx->records_capacity : 256;
        struct hypura_tensor_record * grown = realloc(ctx->records, capacity * sizeof(*grown));
        if (grown == NULL) {
            return GGML_STATUS_ALLOC_FAILED;
        }
        ctx->records = grown;
        ctx->records_capacity = capacity;
    }
    ctx->records[ctx->n_records].tensor = tensor;
    ctx->records[ctx->n_records].offset = offset;
    ctx->n_records++;
    tensor->data = sinking ? ctx->sink : (char *) ctx->base + offset;
    return GGML_STATUS_SUCCESS;
}

static void hypura_buffer_memset_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, uint8_t value, size_t offset, size_t size) {
    (void) buffer; (void) tensor; (void) value; (void) offset; (void) size;
}

static void hypura_buffer_set_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    (void) buffer; (void) tensor; (void) data; (void) offset; (void) size;
}

static void hypura_buffer_get_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    (void) buffer;
    memcpy(data, (const char *) tensor->data + offset, size);
}

static void hypura_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    (void) buffer; (void) value;
}

static const struct ggml_backend_buffer_i hypura_buffer_i = {
    /* .free_buffer   = */ NULL,  // the reservation belongs to the buffer type (freed from Rust)
    /* .get_base      = */ hypura_buffer_get_base,
    /* .init_tensor   = */ hypura_buffer_init_tensor,
    /* .memset_tensor = */ hypura_buffer_memset_tensor,
    /* .set_tensor    = */ hypura_buffer_set_tensor,
    /* .get_tensor    = */ hypura_buffer_get_tensor,
    /* .set_tensor_2d = */ NULL,
    /* .get_tensor_2d = */ NULL,
    /* .cpy_tensor    = */ NULL,
    /* .clear         = */ hypura_buffer_clear,
    /* .reset         = */ NULL,
};

static ggml_backend_buffer_t hypura_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    struct hypura_stream_buft_context * ctx = (struct hypura_stream_buft_context *) buft->context;
    (void) size;  // every tensor lives at its file offset inside the one reservation
    return ggml_backend_buffer_init(buft, hypura_buffer_i, ctx, ctx->size);
}

static size_t hypura_buft_get_alignment(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return 32;  // GGUF's default data alignment; the real address is the file offset's
}

static bool hypura_buft_is_host(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return true;
}

// Create the buffer type over a reservation `base .. base + size` that the caller owns and
// keeps mapped for as long as any model uses this type, with a load-time sink of `sink_size`
// bytes (NULL: tensors point at their mirror address from the start). Returns NULL on
// allocation failure.
ggml_backend_buffer_type_t hypura_stream_buft_new(void * base, size_t size, void * sink, size_t sink_size, hypura_offset_fn offset_of, void * user) {
    struct hypura_stream_buft_context * ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        return NULL;
    }
    ctx->sink = sink;
    ctx->sink_size = sink_size;
    ctx->base = base;
    ctx->size = size;
    ctx->offset_of = offset_of;
    ctx->user = user;
    ctx->buft.iface.get_name = hypura_buft_get_name;
    ctx->buft.iface.alloc_buffer = hypura_buft_alloc_buffer;
    ctx->buft.iface.get_alignment = hypura_buft_get_alignment;
    ctx->buft.iface.is_host = hypura_buft_is_host;
    ctx->buft.device = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ctx->buft.context = ctx;
    return &ctx->buft;
}

// Point every tensor allocated so far at its mirror address; later ones get it directly.
// Returns how many tensors were moved. Call after the load, before any graph runs.
size_t hypura_stream_buft_finalize(ggml_backend_buffer_type_t buft) {
    struct hypura_stream_buft_context * ctx = (struct hypura_stream_buft_context *) buft->context;
    size_t moved = 0;
    if (!ctx->finalized && ctx->sink != NULL) {
        for (size_t i = 0; i < ctx->n_records; i++) {
            ctx->records[i].tensor->data = (char *) ctx->base + ctx->records[i].offset;
        }
        moved = ctx->n_records;
    }
    ctx->finalized = true;
    ctx->sink = NULL;
    return moved;
}

// The tensor of this type named `name`, or NULL. Valid while the model that owns it lives.
struct ggml_tensor * hypura_stream_buft_tensor(ggml_backend_buffer_type_t buft, const char * name) {
    struct hypura_stream_buft_context * ctx = (struct hypura_stream_buft_context *) buft->context;
    for (size_t i = 0; i < ctx->n_records; i++) {
        if (strcmp(ctx->records[i].tensor->name, name) == 0) {
            return ctx->records[i].tensor;
        }
    }
    return NULL;
}

// Free the type (not the reservation). Only after every model using it is freed.
void hypura_stream_buft_free(ggml_backend_buffer_type_t buft) {
    struct hypura_stream_buft_context * ctx = (struct hypura_stream_buft_context *) buft->context;
    free(ctx->records);
    free(ctx);
}
