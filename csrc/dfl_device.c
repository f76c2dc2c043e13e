/* Devices come from ggml's backend registry, so a CUDA/Metal/Vulkan build of ggml is
 * picked up without code changes. */
#include "dfl_error.h"

#include "ggml-backend.h"

#include <netdb.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static const char * device_type_name(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU: return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU: return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU: return "igpu";
        default: return "accel";
    }
}

DFL_API int dfl_device_count(void) {
    return (int) ggml_backend_dev_count();
}

DFL_API dfl_status dfl_device_describe(int i, char * buf, size_t buf_size) {
    if (i < 0 || (size_t) i >= ggml_backend_dev_count()) {
        return dfl_fail(DFL_ERR_ARGUMENT, "device index %d out of range (have %zu)", i, ggml_backend_dev_count());
    }
    ggml_backend_dev_t dev = ggml_backend_dev_get((size_t) i);
    snprintf(buf, buf_size, "%s|%s|%s", ggml_backend_dev_name(dev), ggml_backend_dev_description(dev),
             device_type_name(ggml_backend_dev_type(dev)));
    return DFL_OK;
}

/* Registered once per endpoint: ggml's RPC backend returns the same registration for
 * an endpoint it already knows, and registering it twice would list its devices twice. */
static bool registered(ggml_backend_reg_t reg) {
    for (size_t i = 0; i < ggml_backend_reg_count(); i++) {
        if (ggml_backend_reg_get(i) == reg) {
            return true;
        }
    }
    return false;
}

/* ggml's RPC client aborts the process when it cannot connect: try first. */
static bool reachable(const char * endpoint) {
    char host[256];
    const char * colon = strrchr(endpoint, ':');
    if (!colon || colon == endpoint || (size_t) (colon - endpoint) >= sizeof host || !colon[1]) {
        return false;
    }
    memcpy(host, endpoint, (size_t) (colon - endpoint));
    host[colon - endpoint] = 0;
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM };
    struct addrinfo * res = NULL;
    if (getaddrinfo(host, colon + 1, &hints, &res) != 0) {
        return false;
    }
    bool ok = false;
    for (struct addrinfo * a = res; a && !ok; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd >= 0) {
            ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
            close(fd);
        }
    }
    freeaddrinfo(res);
    return ok;
}

DFL_API dfl_status dfl_rpc_add_server(const char * endpoint) {
    if (!endpoint || !endpoint[0] || !strchr(endpoint, ':')) {
        return dfl_fail(DFL_ERR_ARGUMENT, "RPC endpoint must be host:port, got '%s'", endpoint ? endpoint : "");
    }
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    typedef ggml_backend_reg_t (*add_server_fn)(const char * endpoint);
    add_server_fn add = rpc ? (add_server_fn) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server") : NULL;
    if (!add) {
        return dfl_fail(DFL_ERR_BACKEND, "this ggml build has no RPC backend (build it with -DGGML_RPC=ON)");
    }
    if (!reachable(endpoint)) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot connect to a ggml RPC server at %s", endpoint);
    }
    ggml_backend_reg_t reg = add(endpoint);
    if (!reg) {
        return dfl_fail(DFL_ERR_BACKEND, "no ggml RPC server answers at %s", endpoint);
    }
    if (!registered(reg)) {
        ggml_backend_register(reg);
    }
    return DFL_OK;
}

/* Whether a device's backend carries the project's batch-invariance patch: a patched
 * backend answers the proc address "ggml_backend_batch_invariance" with a function that
 * names its patch (dflash_gguf/data/ggml-patches), a stock one has no such address. The
 * runtime's exactness check (dflash_gguf/runtime/exactness.py) reads it before probing. */
typedef const char * (*batch_invariance_fn)(void);

DFL_API int dfl_device_batch_invariance(const char * device, char * buf, size_t buf_size) {
    ggml_backend_dev_t dev = device && device[0] ? ggml_backend_dev_by_name(device)
                                                 : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : NULL;
    batch_invariance_fn fn =
        reg ? (batch_invariance_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_batch_invariance") : NULL;
    if (buf_size > 0) {
        snprintf(buf, buf_size, "%s", fn ? fn() : "");
    }
    return fn != NULL;
}

DFL_API const char * dfl_ggml_patch_key(void) {
    return DFL_GGML_PATCH_KEY;  /* CMakeLists.txt defines it */
}

/* One device's description, looked up by name: nothing else of the registry is asked (an
 * RPC device whose server went away would abort the process when described). */
DFL_API dfl_status dfl_device_description(const char * device, char * buf, size_t buf_size) {
    ggml_backend_dev_t dev = device && device[0] ? ggml_backend_dev_by_name(device)
                                                 : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) {
        return dfl_fail(DFL_ERR_ARGUMENT, "no device named '%s'", device);
    }
    snprintf(buf, buf_size, "%s", ggml_backend_dev_description(dev));
    return DFL_OK;
}
