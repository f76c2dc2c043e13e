/* GGUF files as weight sources: validated metadata access and weight placement in
 * backend buffers. */
#ifndef DFL_GGUF_H
#define DFL_GGUF_H

#include "dfl_error.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <stdbool.h>

/* Weights go into buffers no larger than their device allows (GPU APIs cap single
 * allocations), so a large model takes several. */
#define DFL_MAX_WEIGHT_BUFFERS 1024
/* Matrices too large for their device to take in one operation (see dfl_gguf_mul_mat). */
#define DFL_MAX_SLICED 4
#define DFL_MAX_SLICES 64

typedef struct dfl_sliced {
    const struct ggml_tensor * whole;
    int n;
    struct ggml_tensor * part[DFL_MAX_SLICES]; /* consecutive row blocks over whole's memory */
} dfl_sliced;

typedef struct dfl_gguf {
    char path[1024];
    struct gguf_context * meta;
    struct ggml_context * ctx;      /* tensor metadata (no data) */
    size_t file_size;
    void * map;                     /* read-only mapping of the whole file */
    bool * used;                    /* per tensor (file order): asked for by the model; only these load */
    ggml_backend_buffer_t buffers[DFL_MAX_WEIGHT_BUFFERS];
    int n_buffers;
    struct ggml_context * ctx_slices;
    dfl_sliced sliced[DFL_MAX_SLICED];
    int n_sliced;
    char arch[64];
} dfl_gguf;

dfl_status dfl_gguf_open(const char * path, dfl_gguf * g);
void dfl_gguf_close(dfl_gguf * g);

/* Typed key access; the key name gets "<arch>." prepended when it starts with '.'.
 * Missing required keys and type mismatches are DFL_ERR_FORMAT. */
dfl_status dfl_gguf_u32(const dfl_gguf * g, const char * key, bool required, uint32_t def, uint32_t * out);
dfl_status dfl_gguf_f32(const dfl_gguf * g, const char * key, bool required, float def, float * out);
dfl_status dfl_gguf_arr_i32(const dfl_gguf * g, const char * key, int32_t * out, int max_n, int * n_out);
dfl_status dfl_gguf_arr_bool(const dfl_gguf * g, const char * key, bool * out, int n);
bool dfl_gguf_has(const dfl_gguf * g, const char * key);

/* A weight tensor with its expected shape (ne[i] == 0 means any); NULL result for an
 * optional tensor that is absent. Vectors (n_dims 1) must be f32, matrices of a type
 * ggml multiplies (float or a quantization with a dot product). Marks it used. */
dfl_status dfl_gguf_tensor(const dfl_gguf * g, const char * name, int n_dims, const int64_t * ne, bool required,
                           struct ggml_tensor ** out);

/* An index vector (I64, n entries: d2t maps) and its values, read from the file into
 * `values` (n of them) before any weight is placed, so that they can be bounded; NULL for
 * an optional one that is absent. Marks it used. */
dfl_status dfl_gguf_index_vector(const dfl_gguf * g, const char * name, int64_t n, bool required,
                                 struct ggml_tensor ** out, int64_t * values);

/* Place tensor i of the file (file order) in memory of dev_of[i] (tensors the model did
 * not ask for through dfl_gguf_tensor are left out): mapped directly from
 * the file when that device can use host memory, otherwise copied once from the
 * mapping. With `repack`, matrices go to the device's faster repacked layouts where it
 * has them. */
dfl_status dfl_gguf_load_weights(dfl_gguf * g, ggml_backend_dev_t const * dev_of, bool repack);
/* Row slices of every placed weight its device takes only in slices (done by
 * dfl_gguf_load_weights; a memory plan calls it over placeholder buffers). */
dfl_status dfl_gguf_slice_weights(dfl_gguf * g);
/* w x for a weight w of g: one product, or one per row slice of w concatenated when w
 * was too large for its device to take whole. */
struct ggml_tensor * dfl_gguf_mul_mat(const dfl_gguf * g, struct ggml_context * ctx, struct ggml_tensor * w,
                                      struct ggml_tensor * x);
/* A new matrix of the given rows of w (a placed matrix of g), in that order, on w's
 * device (repacked as a weight there would be): whole rows copied from the file, each
 * row of a quantized matrix being whole blocks. Its context and buffer are the caller's
 * to free. */
dfl_status dfl_gguf_weight_rows(const dfl_gguf * g, const struct ggml_tensor * w, const int32_t * rows, int n,
                                bool repack, struct ggml_context ** ctx, ggml_backend_buffer_t * buf,
                                struct ggml_tensor ** out);
/* The same with every tensor on dev. */
dfl_status dfl_gguf_load_weights_on(dfl_gguf * g, ggml_backend_dev_t dev, bool repack);

/* The first extra buffer type of dev (the CPU backend's repacked layouts) that runs a
 * matrix product with weight w (2D, or 3D experts); NULL when none does. */
ggml_backend_buffer_type_t dfl_gguf_repack_buft(ggml_backend_dev_t dev, struct ggml_tensor * w);

/* Weights placed by name over dev_of (file order): each placement names a tensor of the
 * file and a device that must be `dev` or `cpu`. Checked; a bad one is DFL_ERR_ARGUMENT. */
dfl_status dfl_gguf_place_by_name(const dfl_gguf * g, const dfl_weight_placement * placements, int n,
                                  ggml_backend_dev_t dev, ggml_backend_dev_t cpu, ggml_backend_dev_t * dev_of);

/* The device of every tensor (file order, malloc'd into *out): dev, but those placed by name. */
dfl_status dfl_gguf_devices(const dfl_gguf * g, const dfl_weight_placement * placements, int n, ggml_backend_dev_t dev,
                            ggml_backend_dev_t cpu, ggml_backend_dev_t ** out);

/* A routed expert's weight (llama.cpp's names: blk.N.ffn_*_exps.*, blk.N.ffn_*_chexps.*). */
bool dfl_gguf_is_expert(const char * name);

#endif
