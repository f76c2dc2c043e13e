/* Thread-local error message shared by every entry point. */
#ifndef DFL_ERROR_H
#define DFL_ERROR_H

#include "dflash.h"

#define DFL_API __attribute__((visibility("default")))

dfl_status dfl_fail(dfl_status status, const char * fmt, ...) __attribute__((format(printf, 2, 3)));
void dfl_clear_error(void);

/* Return the status of x from the enclosing function unless it is DFL_OK. */
#define TRY(x) do { dfl_status s_ = (x); if (s_ != DFL_OK) return s_; } while (0)

#endif
