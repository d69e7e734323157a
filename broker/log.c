/*
 * log.c - writes the broker's log to stderr: a UTC timestamp, the level and
 * the message, one line each, written with a single write so that lines of
 * a broker and its test clients never interleave mid-line.
 */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "gmb.h"

static int log_level = GMB_LOG_INFO;
static const char *log_names[] = {"error", "warn", "info", "debug"};

void gmb__log_set_level(int level) { log_level = level; }
int gmb__log_get_level(void) { return log_level; }

int gmb__log_level_parse(const char *s, int *out) {
  for (int i = 0; i < 4; i++) {
    if (s && strcmp(s, log_names[i]) == 0) {
      *out = i;
      return 0;
    }
  }
  return GMB_E_INVAL;
}

static void log_vwrite(int level, const char *fmt, va_list ap) {
  char line[1024];
  struct timeval tv;
  struct tm tm;
  gettimeofday(&tv, NULL);
  gmtime_r(&tv.tv_sec, &tm);
  int n = snprintf(line, sizeof line,
                   "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ gmb-broker[%d] %s: ",
                   tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                   tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000), (int)getpid(),
                   log_names[level]);
  if (n < 0) return;
  int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  if (m < 0) return;
  size_t len = (size_t)n + (size_t)m;
  if (len > sizeof line - 2) len = sizeof line - 2;
  line[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w; /* nowhere left to report a failed log write */
}

void gmb__log(int level, const char *fmt, ...) {
  if (level > log_level) return;
  va_list ap;
  va_start(ap, fmt);
  log_vwrite(level, fmt, ap);
  va_end(ap);
}

static void log_always(int level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_vwrite(level, fmt, ap);
  va_end(ap);
}

_Noreturn void gmb__assert_fail(const char *cond, const char *file, int line) {
  log_always(GMB_LOG_ERROR, "BUG: assertion failed at %s:%d: %s", file, line,
             cond);
  abort();
}
