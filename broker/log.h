/*
 * log.h - the broker's log (stderr, one line an event) and GMB_ASSERT.
 *
 * A broken invariant is a bug, not an error: GMB_ASSERT logs file:line and
 * the condition, then aborts.  Bad input is never asserted on.
 */
#ifndef GMB_LOG_H
#define GMB_LOG_H

#include <stddef.h>
#include <stdint.h>

enum gmb_log_level {
  GMB_LOG_ERROR = 0,
  GMB_LOG_WARN = 1,
  GMB_LOG_INFO = 2,
  GMB_LOG_DEBUG = 3,
};

void gmb__log_set_level(int level);
int gmb__log_get_level(void);
/* "error|warn|info|debug" to a level; 0 or GMB_E_INVAL. */
int gmb__log_level_parse(const char *s, int *out);
/* Copies `msg` to `out` (at most cap - 1 bytes, NUL-terminated, cut at a
 * whole character) with every control character, and every byte from 0x80
 * up that is not part of printable UTF-8, written as \xHH: text that
 * clients chose (a client name, a tag) and that operators read, in the log
 * or in gmbctl's status, must not forge a line, repaint a terminal, or be
 * bytes a JSON encoder refuses.  Returns the bytes written. */
size_t gmb__log_escape(char *out, size_t cap, const char *msg);

void gmb__log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/*
 * Rate limits for what clients can make the broker log at will (refused
 * Hellos, waiting requests, failed proofs): at most GMB_LOG_RL_BURST lines
 * a second per limiter; the next line allowed says how many were left out.
 *   static struct gmb_log_rl rl;
 *   if (gmb__log_allow(&rl)) log_warn("...%s", ..., gmb__log_suppressed(&rl));
 * A zeroed struct is ready.  Only the loop thread logs through one.
 */
#define GMB_LOG_RL_BURST 10
struct gmb_log_rl {
  uint64_t window_ns;   /* start of the current second */
  uint32_t in_window;   /* lines allowed in it */
  uint64_t suppressed;  /* lines left out in it */
  uint64_t report;      /* left out before, not yet reported */
  char note[64];
};
/* 1 when a line may be written now (and counts it), else 0. */
int gmb__log_allow(struct gmb_log_rl *rl);
/* "" or " (and N more like it, not logged)", for the line allowed. */
const char *gmb__log_suppressed(struct gmb_log_rl *rl);

_Noreturn void gmb__assert_fail(const char *cond, const char *file, int line);

#define GMB_ASSERT(cond) \
  ((cond) ? (void)0 : gmb__assert_fail(#cond, __FILE__, __LINE__))

#define log_error(...) gmb__log(GMB_LOG_ERROR, __VA_ARGS__)
#define log_warn(...) gmb__log(GMB_LOG_WARN, __VA_ARGS__)
#define log_info(...) gmb__log(GMB_LOG_INFO, __VA_ARGS__)
#define log_debug(...)                                             \
  do {                                                             \
    if (gmb__log_get_level() >= GMB_LOG_DEBUG)                     \
      gmb__log(GMB_LOG_DEBUG, __VA_ARGS__);                        \
  } while (0)

#endif /* GMB_LOG_H */
