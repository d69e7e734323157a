/*
 * log.c - writes the broker's log to stderr: a UTC timestamp, the level and
 * the message, one line each, written with a single write so that lines of
 * a broker and its test clients never interleave mid-line.  Control
 * characters in a message are escaped, so a line is always one line.
 */
#include "log.h"

#include <stdarg.h>
#include <stdint.h>
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

/* The length of the UTF-8 sequence at p when it is well formed (shortest
 * form, no surrogate, at most U+10FFFF) and prints as text: not a C1
 * control (U+0080..U+009F: 0x9b is a terminal's CSI), a line or paragraph
 * separator, or a bidirectional override or isolate (text that reads
 * otherwise than it is).  0 otherwise. */
static size_t log_utf8_text(const unsigned char *p) {
  size_t n = p[0] >= 0xf0 ? 4 : p[0] >= 0xe0 ? 3 : p[0] >= 0xc0 ? 2 : 0;
  if (n == 0 || p[0] > 0xf4) return 0;
  uint32_t c = p[0] & (0x7f >> n);
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xc0) != 0x80) return 0; /* the NUL ends it here too */
    c = c << 6 | (p[i] & 0x3f);
  }
  static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (c < least[n] || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return 0;
  if (c <= 0x9f || c == 0x2028 || c == 0x2029 ||
      (c >= 0x202a && c <= 0x202e) || (c >= 0x2066 && c <= 0x2069))
    return 0;
  return n;
}

size_t gmb__log_escape(char *out, size_t cap, const char *msg) {
  static const char hex[] = "0123456789abcdef";
  size_t o = 0;
  for (const unsigned char *p = (const unsigned char *)msg; *p;) {
    size_t n = *p < 0x80 ? (*p >= 0x20 && *p != 0x7f) : log_utf8_text(p);
    if (n == 0) {
      if (o + 4 >= cap) break;
      out[o++] = '\\';
      out[o++] = 'x';
      out[o++] = hex[*p >> 4];
      out[o++] = hex[*p & 15];
      p++;
      continue;
    }
    if (o + n >= cap) break;
    memcpy(out + o, p, n);
    o += n;
    p += n;
  }
  out[o] = '\0';
  return o;
}

static void log_vwrite(int level, const char *fmt, va_list ap) {
  char line[1024], msg[1024];
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
  if (vsnprintf(msg, sizeof msg, fmt, ap) < 0) return;
  size_t len = (size_t)n + gmb__log_escape(line + n, sizeof line - (size_t)n - 1,
                                      msg);
  line[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w; /* nowhere left to report a failed log write */
}

int gmb__log_allow(struct gmb_log_rl *rl) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
  if (rl->window_ns == 0 || now - rl->window_ns >= 1000000000u) {
    rl->window_ns = now ? now : 1;
    rl->in_window = 0;
    rl->report += rl->suppressed;
    rl->suppressed = 0;
  }
  if (rl->in_window < GMB_LOG_RL_BURST) {
    rl->in_window++;
    return 1;
  }
  rl->suppressed++;
  return 0;
}

const char *gmb__log_suppressed(struct gmb_log_rl *rl) {
  if (rl->report == 0) return "";
  snprintf(rl->note, sizeof rl->note, " (and %llu more like it, not logged)",
           (unsigned long long)rl->report);
  rl->report = 0;
  return rl->note;
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
