/* Quantization through ggml's own quantizers, so converted files are bit-compatible
 * with what llama.cpp would write. */
#include "dfl_error.h"

#include "ggml.h"

static dfl_status check_type(int type, int64_t n_per_row) {
    if (type < 0 || type >= GGML_TYPE_COUNT) {
        return dfl_fail(DFL_ERR_ARGUMENT, "unknown ggml type id %d", type);
    }
    const int64_t blck = ggml_blck_size((enum ggml_type) type);
    if (ggml_type_size((enum ggml_type) type) == 0 || blck <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "ggml type %d has no storage layout", type);
    }
    if (n_per_row <= 0 || n_per_row % blck != 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "row length %lld is not a multiple of the %s block size %lld",
                        (long long) n_per_row, ggml_type_name((enum ggml_type) type), (long long) blck);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_quantize(int type, const float * src, void * dst, int64_t nrows, int64_t n_per_row,
                                size_t * out_size) {
    dfl_status st = check_type(type, n_per_row);
    if (st != DFL_OK) {
        return st;
    }
    if (!src || !dst || nrows <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "quantize: null buffer or empty tensor");
    }
    const enum ggml_type t = (enum ggml_type) type;
    if (ggml_quantize_requires_imatrix(t)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "type %s needs an importance matrix, which the converter does not compute",
                        ggml_type_name(t));
    }
    *out_size = ggml_quantize_chunk(t, src, dst, 0, nrows, n_per_row, NULL);
    return DFL_OK;
}
