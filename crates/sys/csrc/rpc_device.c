// A ggml device that is another device with the memory it reports capped, for
// `hypura rpc-server`: ggml's CPU device reports the machine's physical memory as free, which a
// worker in a memory cgroup (or one told to lend less) does not have. Clients plan remote layers
// by this figure, so the worker reports what it can hold.
//
// The memory it reports free is what it lends less what the process has taken since the device
// was made (its resident set's growth: clients' buffers are faulted in as their tensors arrive),
// so a second client, or a second model of the same client, sees what the first one left.
//
// The wrapper shares the inner device's interface and context; only `get_memory`, `get_props`
// and `init_backend` differ. The backends it creates are the inner device's, re-pointed at the
// wrapper, because ggml's RPC server asks a backend's device for the memory it reports.
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ggml-backend-impl.h"

struct hypura_capped_device {
    struct ggml_backend_device device;
    ggml_backend_dev_t inner;
    size_t free_bytes;
    size_t total_bytes;
    size_t resident_at_start;
};

// The process's resident set in bytes (0 where /proc is not there to say).
static size_t resident_bytes(void) {
    size_t bytes = 0;
    FILE * statm = fopen("/proc/self/statm", "r");
    if (statm != NULL) {
        unsigned long size = 0, resident = 0;
        if (fscanf(statm, "%lu %lu", &size, &resident) == 2) {
            bytes = (size_t) resident * (size_t) sysconf(_SC_PAGESIZE);
        }
        fclose(statm);
    }
    return bytes;
}

static void capped_get_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    const struct hypura_capped_device * capped = (const struct hypura_capped_device *) dev;
    size_t now = resident_bytes();
    size_t taken = now > capped->resident_at_start ? now - capped->resident_at_start : 0;
    *free = capped->free_bytes > taken ? capped->free_bytes - taken : 0;
    *total = capped->total_bytes;
}

static void capped_get_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props * props) {
    const struct hypura_capped_device * capped = (const struct hypura_capped_device *) dev;
    capped->inner->iface.get_props(capped->inner, props);
    capped_get_memory(dev, &props->memory_free, &props->memory_total);
}

static ggml_backend_t capped_init_backend(ggml_backend_dev_t dev, const char * params) {
    const struct hypura_capped_device * capped = (const struct hypura_capped_device *) dev;
    ggml_backend_t backend = capped->inner->iface.init_backend(capped->inner, params);
    if (backend != NULL) {
        backend->device = dev;
    }
    return backend;
}

// Never freed: ggml keeps device handles for the life of the process, and so does the server.
ggml_backend_dev_t hypura_capped_device(ggml_backend_dev_t inner, size_t free_bytes, size_t total_bytes) {
    if (inner == NULL || inner->iface.init_backend == NULL || inner->iface.get_props == NULL) {
        return NULL;
    }
    struct hypura_capped_device * capped = calloc(1, sizeof(*capped));
    if (capped == NULL) {
        return NULL;
    }
    capped->device.iface = inner->iface;
    capped->device.iface.get_memory = capped_get_memory;
    capped->device.iface.get_props = capped_get_props;
    capped->device.iface.init_backend = capped_init_backend;
    capped->device.reg = inner->reg;
    capped->device.context = inner->context;
    capped->inner = inner;
    capped->free_bytes = free_bytes;
    capped->total_bytes = total_bytes;
    capped->resident_at_start = resident_bytes();
    return &capped->device;
}
