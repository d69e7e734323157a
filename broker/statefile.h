/*
 * statefile.h - the broker's run-time state file: quotas and reservations an
 * operator set with gmbctl, kept across restarts.
 *
 * The file is the `state` path of [broker] ("" : changes last until the
 * broker stops).  It holds overrides only: a value is in it because an
 * operator set it, and it wins over the config file's value for that
 * tenant, at start and at every reload.  Setting a configured tenant back
 * to exactly its config value removes the override, so later edits of the
 * config apply to it again.  The in-memory overrides and the file are the
 * same at all times: a change is written (atomically) before it is applied,
 * and a change that cannot be written is refused.
 *
 * Format: an INI subset written by the broker (parsed here, not by inih,
 * so that every error names its line),
 *
 *   # comment
 *   version = 1
 *   [tenant:llm-a]
 *   owner = 1001            # a tenant made by first use: its first uid
 *   quota = 21474836480     # 20GiB
 *   reserve = 4294967296    # 4GiB
 *
 * Values are bytes or sizes ("20GiB"); a tenant section may hold either
 * key or both, and `owner` (a uid) for a tenant the config does not name
 * and that proves no one but the uid that made it: so a restart gives it
 * back to that uid with the operator's limits, rather than to whichever
 * local uid names it first.  Anything else is an error that names
 * FILE:LINE.
 */
#ifndef GMB_STATEFILE_H
#define GMB_STATEFILE_H

#include <stddef.h>
#include <stdint.h>

struct gmb_broker;
struct gmb_statefile;

enum gmb_state_field { GMB_STATE_QUOTA = 0, GMB_STATE_RESERVE = 1 };

/*
 * Reads b->cfg.state (a missing file is an empty state) and applies it on
 * top of the tenants the config made; a tenant named only in the state is
 * created, owned by its `owner` when the file names one, else by nobody
 * until first use.  Call once, right after
 * gmb__tenants_new.  0, or GMB_E_INVAL ("FILE:LINE: reason") /
 * GMB_E_SYSTEM ("FILE: reason") in err, in which case nothing was applied,
 * or GMB_E_LIMIT when a tenant it names cannot be created (the registry is
 * full; the overrides before it were applied).  Either way the broker must
 * not start: dropping an operator's limits silently is worse than not
 * starting.
 */
int gmb__statefile_load(struct gmb_broker *b, char *err, size_t errcap);

/*
 * For a reload: reads the state file again (or keeps the in-memory
 * overrides when there is no state path) without applying it.  0, or an
 * error as gmb__statefile_load; the caller then keeps the running config.
 */
int gmb__statefile_reread(struct gmb_broker *b, char *err, size_t errcap);

/* Applies the overrides (the ones gmb__statefile_reread read, if it was called
 * since) to the tenants, creating the missing ones.  Returns how many
 * tenants it touched, or GMB_E_LIMIT when a tenant could not be created
 * (logged). */
int gmb__statefile_apply(struct gmb_broker *b);

/*
 * Records that an operator set `field` of tenant `name` to `value`, and
 * writes the state file.  0, or GMB_E_SYSTEM with the reason in err when
 * the file could not be written, in which case the override is not
 * recorded either (the caller must not apply the change).  Without a state
 * path the override is kept in memory only, and *persisted is 0.
 */
int gmb__statefile_set(struct gmb_broker *b, const char *name,
                       enum gmb_state_field field, uint64_t value,
                       int *persisted, char *err, size_t errcap);

/* 1 with *value set when the overrides (as last read) set `field` of
 * tenant `name`; else 0.  O(overrides). */
int gmb__statefile_lookup(struct gmb_broker *b, const char *name,
                          enum gmb_state_field field, uint64_t *value);
/* Visits the name of every tenant the overrides mention. */
void gmb__statefile_each(struct gmb_broker *b,
                         void (*fn)(void *ctx, const char *name), void *ctx);

/* Frees the in-memory overrides (b->statefile, at exit).  Accepts NULL. */
void gmb__statefile_free(struct gmb_statefile *sf);

#endif /* GMB_STATEFILE_H */
