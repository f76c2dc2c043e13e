/* ggml's messages on stderr, as llama.cpp's tools show them: information, warnings and
 * errors, not debug lines unless asked. ggml's default callback prints every level, so a
 * quantized model's load printed a line per repacked matrix (some 200 for a 1.5B). */
#include "dfl_error.h"

#include "ggml.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_show_debug;
static enum ggml_log_level g_last = GGML_LOG_LEVEL_INFO;  /* a CONT line continues this */

static void to_stderr(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level != GGML_LOG_LEVEL_CONT) {
        g_last = level;
    }
    if (g_last == GGML_LOG_LEVEL_DEBUG && !g_show_debug) {
        return;
    }
    fputs(text, stderr);
    fflush(stderr);
}

DFL_API void dfl_ggml_log(void) {
    const char * debug = getenv("DFLASH_GGML_DEBUG");
    g_show_debug = debug && strcmp(debug, "1") == 0;
    ggml_log_set(to_stderr, NULL);
}
