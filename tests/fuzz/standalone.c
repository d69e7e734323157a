/*
 * standalone.c - runs a libFuzzer target without libFuzzer: each file
 * named on the command line (a directory: each file in it) is one input,
 * given to LLVMFuzzerTestOneInput once, as libFuzzer replays a corpus.
 * `make check` builds the broker's targets with this main and the
 * ordinary compiler (tests/fuzz/seeds.sh), so every seed corpus, the
 * untrusted state files and the descriptors sent on fd.sock among them,
 * runs on every check, not only under `make fuzz` with clang.  An input
 * that breaks an invariant aborts (FZ_ASSERT), which fails the suite;
 * the last line says how many inputs ran.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

/* Runs one file; 0, or -1 when it cannot be read. */
static int sa_run(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return -1;
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *n = realloc(buf, cap);
      if (n == NULL) break;
      buf = n;
    }
    size_t got = fread(buf + len, 1, cap - len, f);
    if (got == 0) break;
    len += got;
  }
  int bad = ferror(f);
  fclose(f);
  if (!bad) LLVMFuzzerTestOneInput(buf ? buf : (const uint8_t *)"", len);
  free(buf);
  return bad ? -1 : 0;
}

int main(int argc, char **argv) {
  LLVMFuzzerInitialize(&argc, &argv);
  size_t n = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "standalone: %s: cannot stat\n", argv[i]);
      return 2;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (sa_run(argv[i]) != 0) {
        fprintf(stderr, "standalone: %s: cannot read\n", argv[i]);
        return 2;
      }
      n++;
      continue;
    }
    struct dirent **names;
    int k = scandir(argv[i], &names, NULL, alphasort);
    if (k < 0) {
      fprintf(stderr, "standalone: %s: cannot list\n", argv[i]);
      return 2;
    }
    for (int j = 0; j < k; j++) {
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", argv[i], names[j]->d_name);
      struct stat fs;
      if (names[j]->d_name[0] != '.' && stat(path, &fs) == 0 &&
          S_ISREG(fs.st_mode)) {
        if (sa_run(path) != 0) {
          fprintf(stderr, "standalone: %s: cannot read\n", path);
          return 2;
        }
        n++;
      }
      free(names[j]);
    }
    free(names);
  }
  printf("standalone: %s: %zu inputs, no invariant broken\n", argv[0], n);
  return n > 0 ? 0 : 2;
}
