/*
 * frag.c - the demo's fragmentation scenario, as one client of the broker.
 *
 *   frag [--tenant T] [--endpoint E] [--block SIZE] [--fill SIZE] [--big SIZE]
 *        [--wait-ms N]
 *
 * Fills the device with movable blocks (--block, default 512KiB, up to
 * --fill, default 56MiB), writes a pattern into every byte of each with
 * gmb_write (a copy: on a GPU the CPU cannot touch device memory), frees every other block - so each segment is left half used
 * and the free space is scattered in block-sized holes - then asks for one
 * --big allocation (default 24MiB) that no hole can hold although the free
 * total can.  With compaction off the broker refuses it (GMB_E_NOMEM, with
 * its figures); with compaction auto it moves blocks to gather the holes
 * and the request succeeds.  On a GPU the segments compaction emptied go
 * back to the device only once every client mapping them (this one too)
 * closed them; --wait-ms N asks with gmb_alloc_wait, which waits up to N
 * ms for that, where gmb_alloc answers at once.  Either way every
 * surviving block is read back
 * with gmb_read, and a block whose address (gmb_lock's) changed was moved:
 *
 *   frag: 28 allocations moved, all bytes intact
 *
 * Exit status: 0 the big request succeeded and every byte is intact; 3 it
 * was refused (every byte still intact); 1 a block lost its bytes, or the
 * broker could not be reached; 2 usage.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmb.h"
#include "size.h"

static void frag_usage(FILE *f) {
  fprintf(f,
          "usage: frag [--tenant T] [--endpoint E] [--block SIZE] [--fill "
          "SIZE] [--big SIZE]\n"
          "  --block SIZE  the movable blocks that fill the device (512KiB)\n"
          "  --fill SIZE   how much to fill with them (56MiB)\n"
          "  --big SIZE    the request that needs the holes gathered (24MiB)\n"
          "  --wait-ms N   wait up to N ms for room (gmb_alloc_wait)\n"
          "exit: 0 big request served, bytes intact; 3 refused, bytes "
          "intact;\n      1 bytes lost or no broker; 2 usage\n");
}

static uint64_t frag_word(uint64_t i, gmb_id id) {
  return (i * 0x9E3779B97F4A7C15ull) ^ (id * 0xD1B54A32D192ED03ull);
}

/* Writes (check 0) or checks (check 1) the pattern of block id; *where
 * receives its address.  Returns 0, 1 when a word differs, or a GMB_E_*.
 * The bytes go through gmb_write/gmb_read (copies): on a GPU the address
 * is a device address, which the CPU cannot dereference. */
static int frag_pattern(gmb_client *c, gmb_id id, uint64_t size, int check,
                        void **where) {
  uint64_t n = size / sizeof(uint64_t);
  uint64_t *w = malloc(n * sizeof *w);
  if (w == NULL) return GMB_E_SYSTEM;
  int rc = 0;
  if (!check) {
    for (uint64_t i = 0; i < n; i++) w[i] = frag_word(i, id);
    rc = gmb_write(c, id, 0, w, n * sizeof *w);
  } else {
    rc = gmb_read(c, id, 0, w, n * sizeof *w);
    for (uint64_t i = 0; rc == 0 && i < n; i++)
      if (w[i] != frag_word(i, id)) rc = 1;
  }
  free(w);
  if (rc < 0) return rc;
  /* Where it is now (a lock pins it only for the look). */
  void *p = NULL;
  int lr = gmb_lock(c, id, &p);
  if (lr != 0) return lr;
  *where = p;
  gmb_unlock(c, id);
  return rc;
}

int main(int argc, char **argv) {
  const char *tenant = NULL, *endpoint = NULL;
  uint64_t block = 512 << 10, fill = 56 << 20, big = 24 << 20;
  int wait_ms = -1; /* -1: gmb_alloc */
  for (int i = 1; i < argc; i++) {
    uint64_t *size = NULL;
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      frag_usage(stdout);
      return 0;
    } else if (strcmp(argv[i], "--tenant") == 0 && i + 1 < argc) {
      tenant = argv[++i];
    } else if (strcmp(argv[i], "--endpoint") == 0 && i + 1 < argc) {
      endpoint = argv[++i];
    } else if (strcmp(argv[i], "--block") == 0) {
      size = &block;
    } else if (strcmp(argv[i], "--fill") == 0) {
      size = &fill;
    } else if (strcmp(argv[i], "--big") == 0) {
      size = &big;
    } else if (strcmp(argv[i], "--wait-ms") == 0 && i + 1 < argc) {
      wait_ms = atoi(argv[++i]);
    } else {
      frag_usage(stderr);
      return 2;
    }
    if (size && (i + 1 >= argc || size_parse(argv[++i], size) != 0 ||
                 *size == 0)) {
      fprintf(stderr, "frag: %s wants a SIZE (e.g. 512KiB)\n", argv[i - 1]);
      return 2;
    }
  }
  size_t n = (size_t)(fill / block);
  if (n < 2) {
    fprintf(stderr, "frag: --fill must hold at least two blocks\n");
    return 2;
  }
  gmb_id *ids = calloc(n, sizeof *ids);
  void **where = calloc(n, sizeof *where);
  gmb_client *c = NULL;
  int rc = 1;
  size_t lost = 0;
  if (ids == NULL || where == NULL) goto out;
  if (gmb_connect(endpoint, tenant, &c) != 0) {
    fprintf(stderr, "frag: %s\n", gmb_last_error(NULL));
    goto out;
  }
  char a[SIZE_BUFSZ], b[SIZE_BUFSZ], d[SIZE_BUFSZ];
  size_t made = 0;
  for (; made < n; made++) {
    rc = gmb_alloc(c, (size_t)block, GMB_MOVABLE, &ids[made]);
    if (rc == 0) rc = frag_pattern(c, ids[made], block, 0, &where[made]);
    if (rc != 0) {
      fprintf(stderr, "frag: block %zu: %s\n", made, gmb_last_error(c));
      rc = 1;
      goto out;
    }
  }
  for (size_t i = 1; i < made; i += 2) {
    if (gmb_free(c, ids[i]) != 0) {
      fprintf(stderr, "frag: free: %s\n", gmb_last_error(c));
      rc = 1;
      goto out;
    }
    ids[i] = 0;
  }
  gmb_stats st;
  if (gmb_tenant_stats(c, &st) == 0)
    printf("frag: %zu movable blocks of %s written, every other one freed: "
           "%s in use in %s of segments, holes of %s\n",
           made, size_format(block, a, sizeof a),
           size_format(st.used, b, sizeof b),
           size_format(st.segments, d, sizeof d),
           size_format(block, a, sizeof a));
  gmb_id bigid = 0;
  rc = wait_ms >= 0 ? gmb_alloc_wait(c, (size_t)big, 0, wait_ms, &bigid)
                    : gmb_alloc(c, (size_t)big, 0, &bigid);
  if (rc == 0)
    printf("frag: alloc %s -> ok\n", size_format(big, a, sizeof a));
  else
    printf("frag: alloc %s -> %s\n", size_format(big, a, sizeof a),
           gmb_last_error(c));
  /* Every surviving block, read back where it is now. */
  size_t moved = 0;
  for (size_t i = 0; i < made; i += 2) {
    void *now = NULL;
    int v = frag_pattern(c, ids[i], block, 1, &now);
    if (v != 0)
      lost++;
    else if (now != where[i])
      moved++;
  }
  if (lost)
    printf("frag: %zu allocations moved, %zu LOST their bytes\n", moved, lost);
  else
    printf("frag: %zu allocations moved, all bytes intact\n", moved);
  if (bigid) gmb_free(c, bigid);
  rc = lost ? 1 : rc == 0 ? 0 : 3;
out:
  gmb_disconnect(c);
  free(ids);
  free(where);
  return rc;
}
