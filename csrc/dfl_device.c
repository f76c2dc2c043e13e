/* Devices come from ggml's backend registry, so a CUDA/Metal/Vulkan build of ggml is
 * picked up without code changes. */
#include "dfl_error.h"

#include "ggml-backend.h"

#include <stdio.h>

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
