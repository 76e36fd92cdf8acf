// Two processes through the HIXL engine API on ferry (ferry/hixl.h), every byte checked.
//
// The child is the server: Initialize("127.0.0.1:PORT") listens, MallocMem + RegisterMem expose 1 MiB
// filled with a pattern, and GetNotifies waits for the client's "done". The parent is the client:
// Initialize("127.0.0.1") does not listen; it connects, reads everything back with TransferSync,
// writes a new pattern (half in 256 descriptors, half with TransferAsync + GetTransferStatus) and
// sends "done". Then the server checks every byte. The port comes through a pipe.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/hixl.h"

using namespace hixl;

namespace {

constexpr size_t kLen = 1 << 20;

unsigned char Pattern(size_t i, unsigned seed) { return static_cast<unsigned char>((i * 31u + seed) ^ (i >> 8)); }

int Fail(const char *what, Status s) {
  std::fprintf(stderr, "%s: status %u: %s\n", what, s, Hixl::LastError());
  return 1;
}

#define CHECK(call)                          \
  do {                                       \
    Status s_ = (call);                      \
    if (s_ != SUCCESS) return Fail(#call, s_); \
  } while (0)

#define EXPECT(call, want)                                                                  \
  do {                                                                                      \
    Status s_ = (call);                                                                     \
    if (s_ != (want)) {                                                                     \
      std::fprintf(stderr, "%s: status %u, expected %u (%s)\n", #call, s_, (want), Hixl::LastError()); \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

struct Hello {
  char addr[64];
  uint64_t region;
};

}  // namespace

int ServerMain(int to_parent, const std::string &listen) {
  Hixl engine;
  CHECK(engine.Initialize(listen.c_str(), {{OPTION_TRANSPORTS, "tcp"}, {OPTION_BUFFER_POOL, "4:8"}}));
  void *mem = nullptr;
  CHECK(engine.MallocMem(MEM_HOST, kLen, &mem));
  auto *bytes = static_cast<unsigned char *>(mem);
  for (size_t i = 0; i < kLen; i++) bytes[i] = Pattern(i, 7);
  Hello h{};
  std::snprintf(h.addr, sizeof h.addr, "%s", listen.c_str());
  h.region = reinterpret_cast<uintptr_t>(mem);
  if (write(to_parent, &h, sizeof h) != static_cast<ssize_t>(sizeof h)) return Fail("write", FAILED);
  close(to_parent);

  bool done = false;
  for (int tries = 0; tries < 3000 && !done; tries++) {
    std::vector<NotifyDesc> notifies;
    CHECK(engine.GetNotifies(notifies));
    for (const auto &n : notifies) {
      done |= std::string(n.name.GetString()) == "done" && std::string(n.notify_msg.GetString()) == "all written";
    }
    if (!done) usleep(10000);
  }
  if (!done) return Fail("waiting for done", TIMEOUT);
  for (size_t i = 0; i < kLen; i++) {
    if (bytes[i] != Pattern(i, 11)) {
      std::fprintf(stderr, "server: byte %zu is %u, expected %u\n", i, bytes[i], Pattern(i, 11));
      return 1;
    }
  }
  CHECK(engine.FreeMem(mem));
  EXPECT(engine.FreeMem(mem), PARAM_INVALID);
  engine.Finalize();
  std::printf("server: every byte written arrived\n");
  return 0;
}

int ClientMain(int from_child) {
  Hello h{};
  if (read(from_child, &h, sizeof h) != static_cast<ssize_t>(sizeof h)) return Fail("read", FAILED);
  int32_t value = -1;
  CHECK(Hixl::GetCapability(FEATURE_TCP, value));
  if (value != FEATURE_SUPPORTED) return Fail("TCP unsupported", FAILED);
  EXPECT(Hixl::GetCapability(static_cast<FeatureType>(-1), value), PARAM_INVALID);

  adxl::AdxlEngine engine;  // the same engine under ADXL's name
  CHECK(engine.Initialize("127.0.0.1", {{OPTION_TRANSPORTS, "tcp"}}));
  std::vector<unsigned char> local(kLen, 0);
  MemHandle handle = nullptr;
  CHECK(engine.RegisterMem(MemDesc{reinterpret_cast<uintptr_t>(local.data()), kLen}, MEM_HOST, handle));
  // MEM_DEVICE is CUDA device memory, which host memory is not: UNSUPPORTED without a CUDA driver,
  // PARAM_INVALID where the driver says the address is none of its allocations.
  MemHandle device = nullptr;
  Status as_device = engine.RegisterMem(MemDesc{reinterpret_cast<uintptr_t>(local.data()), kLen}, MEM_DEVICE, device);
  if (as_device != UNSUPPORTED && as_device != PARAM_INVALID) return Fail("RegisterMem(host memory, MEM_DEVICE)", as_device);

  const std::vector<TransferOpDesc> all{{reinterpret_cast<uintptr_t>(local.data()), h.region, kLen}};
  EXPECT(engine.TransferSync(h.addr, READ, all), NOT_CONNECTED);
  CHECK(engine.Connect(h.addr, 5000));
  EXPECT(engine.Connect(h.addr, 5000), ALREADY_CONNECTED);
  CHECK(engine.TransferSync(h.addr, READ, all, 10000));
  for (size_t i = 0; i < kLen; i++) {
    if (local[i] != Pattern(i, 7)) {
      std::fprintf(stderr, "client: read byte %zu is %u, expected %u\n", i, local[i], Pattern(i, 7));
      return 1;
    }
  }

  for (size_t i = 0; i < kLen; i++) local[i] = Pattern(i, 11);
  std::vector<TransferOpDesc> half;
  for (size_t i = 0; i < 256; i++) {
    half.push_back({reinterpret_cast<uintptr_t>(local.data()) + i * 2048, h.region + i * 2048, 2048});
  }
  CHECK(engine.TransferSync(h.addr, WRITE, half, 10000));
  TransferReq req = nullptr;
  const std::vector<TransferOpDesc> rest{
      {reinterpret_cast<uintptr_t>(local.data()) + kLen / 2, h.region + kLen / 2, kLen / 2}};
  CHECK(engine.TransferAsync(h.addr, WRITE, rest, TransferArgs{}, req));
  TransferStatus status = TransferStatus::WAITING;
  for (int tries = 0; tries < 10000 && status == TransferStatus::WAITING; tries++) {
    CHECK(engine.GetTransferStatus(req, status));
    if (status == TransferStatus::WAITING) usleep(1000);
  }
  if (status != TransferStatus::COMPLETED) return Fail("the asynchronous write", FAILED);
  EXPECT(engine.GetTransferStatus(req, status), PARAM_INVALID);  // released after its final state

  const std::vector<TransferOpDesc> outside{{reinterpret_cast<uintptr_t>(local.data()), h.region + kLen, 16}};
  EXPECT(engine.TransferSync(h.addr, WRITE, outside), PARAM_INVALID);
  CHECK(engine.SendNotify(h.addr, NotifyDesc{"done", "all written"}, 5000));
  CHECK(engine.Disconnect(h.addr, 5000));
  EXPECT(engine.Disconnect(h.addr, 5000), NOT_CONNECTED);
  CHECK(engine.DeregisterMem(handle));
  EXPECT(engine.DeregisterMem(handle), PARAM_INVALID);
  engine.Finalize();
  EXPECT(engine.Connect(h.addr, 1000), PARAM_INVALID);  // after Finalize: refused, no crash
  std::printf("client: every byte read back, every careless call refused\n");
  return 0;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len) != 0) {
    std::perror("finding a free port");
    std::exit(1);
  }
  close(fd);
  return ntohs(a.sin_port);
}

int main(int argc, char **argv) {
  // HIXL listens on the port it is given (0 means "do not listen"): a free one, from the kernel.
  std::string listen = argc > 1 ? argv[1] : "127.0.0.1:" + std::to_string(FreePort());
  int fds[2];
  if (pipe(fds) != 0) return Fail("pipe", FAILED);
  pid_t child = fork();
  if (child < 0) return Fail("fork", FAILED);
  if (child == 0) {
    close(fds[0]);
    int rc = ServerMain(fds[1], listen);
    std::fflush(stdout);
    _exit(rc);
  }
  close(fds[1]);
  int rc = ClientMain(fds[0]);
  int status = 0;
  if (waitpid(child, &status, 0) != child) return Fail("waitpid", FAILED);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "the server process failed (status %d)\n", status);
    return 1;
  }
  return rc;
}
