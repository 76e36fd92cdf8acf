/* Two processes through ferry's C ABI, every byte checked.
 *
 * The process forks: the child is the target (it listens, allocates 1 MiB, fills it, tells the parent
 * its address and the region's through a pipe, then waits for the parent's "done" notification and
 * checks what was written); the parent is the initiator (it reads the region back, writes half of it
 * in 256 descriptors, writes the rest asynchronously, and exercises the errors a careless caller
 * meets). Exit status 0 only if both sides saw exactly the bytes they should.
 *
 * Build: cc two_processes.c -I../include -L<target dir> -lferry -Wl,-rpath,<target dir> */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry.h"

#define LEN (1u << 20)

static int fail(const char *what, ferry_status s) {
  fprintf(stderr, "%s: status %d: %s\n", what, (int)s, ferry_last_error());
  return 1;
}

#define CHECK(call)                         \
  do {                                      \
    ferry_status s_ = (call);               \
    if (s_ != FERRY_OK) return fail(#call, s_); \
  } while (0)

#define EXPECT(call, want)                                                          \
  do {                                                                              \
    ferry_status s_ = (call);                                                       \
    if (s_ != (want)) {                                                             \
      fprintf(stderr, "%s: status %d, expected %d (%s)\n", #call, (int)s_, (int)(want), \
              ferry_last_error());                                                  \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

static unsigned char pattern(size_t i, unsigned seed) { return (unsigned char)((i * 31u + seed) ^ (i >> 8)); }

struct hello {
  char addr[64];
  uint64_t region;
};

static int target(int to_parent) {
  ferry_engine_options o;
  CHECK(ferry_engine_options_init(&o));
  o.listen = "127.0.0.1:0";
  o.transports = "tcp";
  uint64_t engine = 0;
  CHECK(ferry_engine_create(&o, &engine));
  void *mem = NULL;
  uint64_t region = 0;
  CHECK(ferry_alloc_host(engine, LEN, FERRY_ACCESS_READ | FERRY_ACCESS_WRITE, &mem, &region));
  unsigned char *bytes = mem;
  for (size_t i = 0; i < LEN; i++) bytes[i] = pattern(i, 7);

  struct hello h;
  memset(&h, 0, sizeof h);
  size_t needed = 0;
  CHECK(ferry_engine_local_addr(engine, h.addr, sizeof h.addr, &needed));
  h.region = (uint64_t)(uintptr_t)mem;
  if (write(to_parent, &h, sizeof h) != (ssize_t)sizeof h) return fail("writing to the parent", FERRY_IO);
  close(to_parent);

  /* Wait for "done" (at most 30 s), then check every byte: the parent wrote pattern 11 everywhere. */
  static ferry_notification got[4];
  int done = 0;
  for (int tries = 0; tries < 3000 && !done; tries++) {
    size_t n = 0;
    CHECK(ferry_take_notifications(engine, got, 4, &n));
    for (size_t i = 0; i < n; i++) done |= strcmp(got[i].name, "done") == 0 && strcmp(got[i].msg, "all written") == 0;
    if (!done) usleep(10000);
  }
  if (!done) return fail("waiting for the done notification", FERRY_TIMEOUT);
  for (size_t i = 0; i < LEN; i++) {
    if (bytes[i] != pattern(i, 11)) {
      fprintf(stderr, "target: byte %zu is %u, expected %u\n", i, bytes[i], pattern(i, 11));
      return 1;
    }
  }
  CHECK(ferry_deregister(engine, region));
  CHECK(ferry_engine_destroy(engine));
  printf("target: every byte written arrived\n");
  return 0;
}

static int initiator(int from_child) {
  struct hello h;
  if (read(from_child, &h, sizeof h) != (ssize_t)sizeof h) return fail("reading the child's address", FERRY_IO);

  ferry_engine_options o;
  CHECK(ferry_engine_options_init(&o));
  o.transports = "tcp";
  uint64_t engine = 0;
  CHECK(ferry_engine_create(&o, &engine));
  unsigned char *local = malloc(LEN);
  if (!local) return fail("malloc", FERRY_RESOURCE_EXHAUSTED);
  memset(local, 0, LEN);
  uint64_t region = 0;
  CHECK(ferry_register(engine, local, LEN, FERRY_ACCESS_READ | FERRY_ACCESS_WRITE, &region));

  /* Not linked yet: refused, and named. */
  ferry_op_desc one = {(uint64_t)(uintptr_t)local, h.region, 4096};
  EXPECT(ferry_transfer_sync(engine, h.addr, FERRY_READ, &one, 1, 1000), FERRY_NOT_CONNECTED);
  CHECK(ferry_connect(engine, h.addr, 5000));
  EXPECT(ferry_connect(engine, h.addr, 5000), FERRY_ALREADY_CONNECTED);

  /* Read the whole region back: pattern 7. */
  ferry_op_desc all = {(uint64_t)(uintptr_t)local, h.region, LEN};
  CHECK(ferry_transfer_sync(engine, h.addr, FERRY_READ, &all, 1, 10000));
  for (size_t i = 0; i < LEN; i++) {
    if (local[i] != pattern(i, 7)) {
      fprintf(stderr, "initiator: read byte %zu is %u, expected %u\n", i, local[i], pattern(i, 7));
      return 1;
    }
  }

  /* Write pattern 11: the first half in 256 descriptors of 2 KiB, the second half asynchronously. */
  for (size_t i = 0; i < LEN; i++) local[i] = pattern(i, 11);
  static ferry_op_desc descs[256];
  for (size_t i = 0; i < 256; i++) {
    descs[i].local_addr = (uint64_t)(uintptr_t)local + i * 2048;
    descs[i].remote_addr = h.region + i * 2048;
    descs[i].len = 2048;
  }
  CHECK(ferry_transfer_sync(engine, h.addr, FERRY_WRITE, descs, 256, 10000));
  ferry_op_desc rest = {(uint64_t)(uintptr_t)local + LEN / 2, h.region + LEN / 2, LEN / 2};
  uint64_t request = 0;
  CHECK(ferry_transfer_async(engine, h.addr, FERRY_WRITE, &rest, 1, 10000, &request));
  ferry_transfer_status status = FERRY_TRANSFER_WAITING;
  for (int tries = 0; tries < 10000 && status == FERRY_TRANSFER_WAITING; tries++) {
    CHECK(ferry_get_transfer_status(engine, request, &status));
    if (status == FERRY_TRANSFER_WAITING) usleep(1000);
  }
  if (status != FERRY_TRANSFER_COMPLETED) return fail("the asynchronous write", FERRY_INTERNAL);
  /* A request that reported its final state is released. */
  EXPECT(ferry_get_transfer_status(engine, request, &status), FERRY_INVALID_HANDLE);

  /* Careless calls: refused, never a crash. */
  EXPECT(ferry_transfer_sync(engine, h.addr, FERRY_WRITE, NULL, 1, 1000), FERRY_INVALID_ARGUMENT);
  EXPECT(ferry_transfer_sync(engine, h.addr, 7, &one, 1, 1000), FERRY_INVALID_ARGUMENT);
  ferry_op_desc outside = {(uint64_t)(uintptr_t)local, h.region + LEN, 16};
  EXPECT(ferry_transfer_sync(engine, h.addr, FERRY_WRITE, &outside, 1, 1000), FERRY_OUT_OF_BOUNDS);
  EXPECT(ferry_register(engine, NULL, 16, FERRY_ACCESS_READ, &region), FERRY_INVALID_ARGUMENT);
  int32_t supported = -1;
  CHECK(ferry_get_capability(FERRY_FEATURE_TCP, &supported));
  if (supported != 1) return fail("TCP reported unsupported", FERRY_INTERNAL);
  EXPECT(ferry_get_capability(999, &supported), FERRY_UNSUPPORTED);

  CHECK(ferry_notify(engine, h.addr, "done", "all written", 5000));
  CHECK(ferry_deregister(engine, region));
  EXPECT(ferry_deregister(engine, region), FERRY_INVALID_HANDLE);
  CHECK(ferry_engine_destroy(engine));
  EXPECT(ferry_engine_destroy(engine), FERRY_INVALID_HANDLE);
  EXPECT(ferry_connect(engine, h.addr, 1000), FERRY_INVALID_HANDLE);
  free(local);
  printf("initiator: every byte read back, every careless call refused\n");
  return 0;
}

int main(void) {
  int fds[2];
  if (pipe(fds) != 0) return fail("pipe", FERRY_IO);
  pid_t child = fork();
  if (child < 0) return fail("fork", FERRY_IO);
  if (child == 0) {
    close(fds[0]);
    int rc = target(fds[1]);
    fflush(stdout);
    _exit(rc);
  }
  close(fds[1]);
  int rc = initiator(fds[0]);
  int status = 0;
  if (waitpid(child, &status, 0) != child) return fail("waitpid", FERRY_IO);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "the target process failed (status %d)\n", status);
    return 1;
  }
  return rc;
}
