/*
 * rbtree.h - libbsd's red-black tree macros (sys/tree.h), usable from C11.
 *
 * RB_GENERATE_STATIC marks its functions `__unused`, which libbsd's cdefs.h
 * leaves undefined on Linux (a kernel struct has a member of that name), so
 * it is defined here, and only for code that includes this header.
 */
#ifndef GMB_RBTREE_H
#define GMB_RBTREE_H

#ifndef __unused
#define __unused __attribute__((__unused__))
#endif
#include <bsd/sys/tree.h>

#endif /* GMB_RBTREE_H */
