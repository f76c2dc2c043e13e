#include "dfl_error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char g_error[1024] = "no error";

dfl_status dfl_fail(dfl_status status, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
    return status;
}

void dfl_clear_error(void) {
    snprintf(g_error, sizeof g_error, "no error");
}

DFL_API const char * dfl_last_error(void) {
    return g_error;
}
