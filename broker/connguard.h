/*
 * connguard.h - a bound on the connections libzmq accepts for the broker.
 *
 * libzmq accepts a client's connection in its I/O thread as soon as it
 * arrives, before the broker sees any message, and aborts the process when
 * accept() fails with EMFILE (ipc_listener.cpp, libzmq 4.3).  A local user
 * who opens a thousand bare connections to broker.sock would stop the
 * broker of every tenant.  The broker therefore defines accept() and
 * accept4() itself (an executable's definitions come before libc's for
 * the libraries it loads), and close() to see connections end, and:
 *   - refuses (closes at once, ECONNABORTED to libzmq, which carries on) a
 *     Unix-socket connection past `total_max` connections in all, or past
 *     `per_uid_max` of its peer's uid (SO_PEERCRED; root is not capped per
 *     uid, only in all);
 *   - when accept() meets EMFILE or ENFILE anyway, takes the connection on
 *     a spare descriptor and closes it, so that libzmq never sees either.
 * Connections to the admin socket count apart, so that the operator gets
 * in during a flood of the client socket: an operator's uid (the
 * broker's, admin_uids) up to 64 connections, any other uid (the socket is
 * 0666 when admin_uids names others) up to 4, and those together up to 64.
 * The descriptor channel caps its own, and other descriptors (files,
 * memfds, the metrics endpoint's TCP connections) pass through untouched.
 *
 * Connections to the client and the admin socket also have their ZeroMQ
 * handshake read as libzmq receives it (recv(), defined here as well):
 * one that is not ZMTP 3 with the NULL mechanism, or whose READY names a
 * routing id of the peer's choosing, is dropped (libzmq 4.3 aborts when a
 * number it gives an anonymous peer is one a peer chose; connguard.c).
 * After the handshake their frames' headers are read too: a message of
 * more than 4 parts drops its connection (libzmq keeps a message's
 * parts until its last, however many; ZMQ_MAXMSGSIZE bounds one part).
 *
 * A bare connection that never completes ZeroMQ's handshake is dropped by
 * libzmq after ZMQ_HANDSHAKE_IVL; one that completes it but never says
 * Hello holds its place until it goes: the per-uid cap keeps one uid from
 * holding every place.
 */
#ifndef GMB_CONNGUARD_H
#define GMB_CONNGUARD_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Starts counting the connections to the Unix socket at `path` (the
 * client socket) and reading the handshakes of those to it and to
 * `admin_path` (call before they are bound): sizes the table by the
 * RLIMIT_NOFILE now in force and opens the spare descriptor.  0, or -1
 * with errno (the guard then stays off and accept() passes through). */
int gmb__connguard_init(const char *path, const char *admin_path);
/* The operators' uids (admin_uids; the broker's own is always one), whose
 * connections to the admin socket are capped apart from other uids'. */
void gmb__connguard_admins(const uid_t *uids, size_t n);
/* The caps; 0: none.  Safe at any time (a reload lowers them: the
 * connections above stay until they end). */
void gmb__connguard_limits(uint32_t total_max, uint32_t per_uid_max);

struct gmb_connguard_stats {
  uint32_t connections;   /* counted now */
  uint64_t refused_total; /* past total_max */
  uint64_t refused_uid;   /* past per_uid_max */
  uint64_t refused_fds;   /* accept() met EMFILE/ENFILE */
  uint64_t refused_handshake; /* chose a routing id, or not ZMTP 3 NULL */
  uint64_t refused_parts; /* sent a message of too many parts */
  uint64_t refused_admin; /* past the admin socket's caps */
  uint32_t admin_others;  /* admin-socket connections of non-operators now */
};
void gmb__connguard_stats(struct gmb_connguard_stats *out);

#endif
