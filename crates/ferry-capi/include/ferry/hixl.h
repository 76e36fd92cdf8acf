/* The HIXL / ADXL transfer engine API (hixl::Hixl, adxl::AdxlEngine) on ferry, header-only C++17 on
 * top of ferry's C ABI (ferry.h, libferry). A program written against HIXL's engine includes this
 * header instead of HIXL's and links libferry: the class, method, type and status names, and the
 * semantics below, are HIXL's.
 *
 * - Initialize("ip:port", options): a port above 0 listens; "ip" alone (or port 0) does not.
 *   Options: OPTION_BUFFER_POOL ("BUFFER_NUM:BUFFER_SIZE_MB", "0:0" off), OPTION_RDMA_TRAFFIC_CLASS,
 *   OPTION_RDMA_SERVICE_LEVEL, and ferry's own OPTION_TRANSPORTS ("tcp,shm,rdma").
 * - Remote engines are named by the "ip:port" they listen on, as passed to Connect.
 * - GetTransferStatus releases a request once it reports COMPLETED, TIMEOUT or FAILED; a later
 *   query with it returns PARAM_INVALID (never a crash).
 * - MemHandle and TransferReq carry ferry's numeric handles: one freed twice, or used after
 *   Finalize, is refused with PARAM_INVALID.
 * - MEM_DEVICE memory is CUDA device memory (ferry_register_device, ferry_alloc_device): UNSUPPORTED
 *   without a CUDA driver, PARAM_INVALID for an address the driver does not know as device memory.
 * - LastError() (ferry's addition) says why the last call on this thread failed. */

#ifndef FERRY_HIXL_H
#define FERRY_HIXL_H

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "../ferry.h"

namespace hixl {

using Status = uint32_t;
constexpr Status SUCCESS = 0U;
constexpr Status PARAM_INVALID = 103900U;
constexpr Status TIMEOUT = 103901U;
constexpr Status NOT_CONNECTED = 103902U;
constexpr Status ALREADY_CONNECTED = 103903U;
constexpr Status NOTIFY_FAILED = 103904U;
constexpr Status UNSUPPORTED = 103905U;
/* ferry's: a limit was reached (links, pending notifications, memory). */
constexpr Status RESOURCE_EXHAUSTED = 103906U;
constexpr Status FAILED = 503900U;

constexpr const char *OPTION_BUFFER_POOL = "BufferPool";
constexpr const char *OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass";
constexpr const char *OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel";
constexpr const char *OPTION_TRANSPORTS = "FerryTransports";

/* The string type of HIXL's signatures. */
class AscendString {
 public:
  AscendString() = default;
  AscendString(const char *s) : s_(s == nullptr ? "" : s) {}
  AscendString(const std::string &s) : s_(s) {}
  const char *GetString() const { return s_.c_str(); }
  size_t GetLength() const { return s_.size(); }
  bool operator<(const AscendString &o) const { return s_ < o.s_; }
  bool operator==(const AscendString &o) const { return s_ == o.s_; }
  bool operator!=(const AscendString &o) const { return s_ != o.s_; }

 private:
  std::string s_;
};

struct MemDesc {
  uintptr_t addr;
  size_t len;
  uint8_t reserved[128] = {};
};
using MemHandle = void *;
enum MemType { MEM_DEVICE, MEM_HOST };
enum TransferOp { READ, WRITE };
struct TransferOpDesc {
  uintptr_t local_addr;
  uintptr_t remote_addr;
  size_t len;
};
struct TransferArgs {
  uint8_t reserved[128] = {};
};
using TransferReq = void *;
enum class TransferStatus { WAITING, COMPLETED, TIMEOUT, FAILED };
struct NotifyDesc {
  AscendString name;
  AscendString notify_msg;
};
/* What GetCapability can be asked about (ferry's features). */
enum FeatureType : int32_t {
  FEATURE_TCP = FERRY_FEATURE_TCP,
  FEATURE_SHM = FERRY_FEATURE_SHM,
  FEATURE_RDMA = FERRY_FEATURE_RDMA,
  FEATURE_NOTIFY = FERRY_FEATURE_NOTIFY,
  FEATURE_ASYNC_TRANSFER = FERRY_FEATURE_ASYNC_TRANSFER,
  FEATURE_CLIENT_SERVER = FERRY_FEATURE_LISTEN,
};
constexpr int32_t FEATURE_SUPPORTED = 1;
constexpr int32_t FEATURE_NOT_SUPPORTED = 0;

namespace detail {
inline Status ToStatus(ferry_status s) {
  switch (s) {
    case FERRY_OK: return SUCCESS;
    case FERRY_INVALID_ARGUMENT:
    case FERRY_OUT_OF_BOUNDS:
    case FERRY_INVALID_HANDLE: return PARAM_INVALID;
    case FERRY_TIMEOUT: return TIMEOUT;
    case FERRY_NOT_CONNECTED: return NOT_CONNECTED;
    case FERRY_ALREADY_CONNECTED: return ALREADY_CONNECTED;
    case FERRY_RESOURCE_EXHAUSTED: return RESOURCE_EXHAUSTED;
    case FERRY_UNSUPPORTED: return UNSUPPORTED;
    default: return FAILED;
  }
}
inline void *ToHandle(uint64_t h) { return reinterpret_cast<void *>(static_cast<uintptr_t>(h)); }
inline uint64_t FromHandle(const void *h) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(h)); }
/* Asynchronous transfers have no timeout in HIXL (the caller decides); ferry's is set this far out. */
constexpr int32_t kAsyncTimeoutMs = 24 * 3600 * 1000;
}  // namespace detail

class Hixl {
 public:
  Hixl() = default;
  ~Hixl() { Finalize(); }
  Hixl(const Hixl &) = delete;
  Hixl &operator=(const Hixl &) = delete;

  Status Initialize(const AscendString &local_engine, const std::map<AscendString, AscendString> &options) {
    if (engine_ != 0) return PARAM_INVALID;
    std::string local = local_engine.GetString();
    std::string listen;
    auto colon = local.rfind(':');
    if (colon != std::string::npos) {
      char *end = nullptr;
      long port = std::strtol(local.c_str() + colon + 1, &end, 10);
      if (end == local.c_str() + colon + 1 || *end != '\0' || port > 65535) return PARAM_INVALID;
      if (port > 0) listen = local;
    }
    ferry_engine_options o;
    ferry_engine_options_init(&o);
    if (!listen.empty()) o.listen = listen.c_str();
    std::string pool, transports;
    for (const auto &kv : options) {
      std::string key = kv.first.GetString(), value = kv.second.GetString();
      if (key == OPTION_BUFFER_POOL) {
        pool = value;
        o.buffer_pool = pool.c_str();
      } else if (key == OPTION_RDMA_TRAFFIC_CLASS || key == OPTION_RDMA_SERVICE_LEVEL) {
        char *end = nullptr;
        long v = std::strtol(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0' || v < 0 || v > 255) return PARAM_INVALID;
        (key == OPTION_RDMA_TRAFFIC_CLASS ? o.rdma_traffic_class : o.rdma_service_level) = static_cast<int32_t>(v);
      } else if (key == OPTION_TRANSPORTS) {
        transports = value;
        o.transports = transports.c_str();
      } else {
        return PARAM_INVALID;
      }
    }
    return detail::ToStatus(ferry_engine_create(&o, &engine_));
  }

  void Finalize() {
    if (engine_ != 0) {
      ferry_engine_destroy(engine_);
      engine_ = 0;
    }
  }

  Status RegisterMem(const MemDesc &mem, MemType type, MemHandle &mem_handle) {
    uint64_t h = 0;
    void *addr = reinterpret_cast<void *>(mem.addr);
    const uint32_t rw = FERRY_ACCESS_READ | FERRY_ACCESS_WRITE;
    ferry_status s = type == MEM_DEVICE ? ferry_register_device(engine_, addr, mem.len, rw, &h)
                                        : ferry_register(engine_, addr, mem.len, rw, &h);
    if (s == FERRY_OK) mem_handle = detail::ToHandle(h);
    return detail::ToStatus(s);
  }

  Status DeregisterMem(MemHandle mem_handle) {
    return detail::ToStatus(ferry_deregister(engine_, detail::FromHandle(mem_handle)));
  }

  Status Connect(const AscendString &remote_engine, int32_t timeout_in_millis = 1000) {
    return detail::ToStatus(ferry_connect(engine_, remote_engine.GetString(), timeout_in_millis));
  }

  Status Disconnect(const AscendString &remote_engine, int32_t timeout_in_millis = 1000) {
    return detail::ToStatus(ferry_disconnect(engine_, remote_engine.GetString(), timeout_in_millis));
  }

  Status TransferSync(const AscendString &remote_engine, TransferOp operation,
                      const std::vector<TransferOpDesc> &op_descs, int32_t timeout_in_millis = 1000) {
    std::vector<ferry_op_desc> descs = Descs(op_descs);
    return detail::ToStatus(ferry_transfer_sync(engine_, remote_engine.GetString(), Op(operation), descs.data(),
                                                descs.size(), timeout_in_millis));
  }

  Status TransferAsync(const AscendString &remote_engine, TransferOp operation,
                       const std::vector<TransferOpDesc> &op_descs, const TransferArgs &optional_args,
                       TransferReq &req) {
    (void)optional_args;
    std::vector<ferry_op_desc> descs = Descs(op_descs);
    uint64_t h = 0;
    ferry_status s = ferry_transfer_async(engine_, remote_engine.GetString(), Op(operation), descs.data(),
                                          descs.size(), detail::kAsyncTimeoutMs, &h);
    if (s == FERRY_OK) req = detail::ToHandle(h);
    return detail::ToStatus(s);
  }

  /* Not const in spirit (a final state releases the request), const as HIXL declares it. */
  Status GetTransferStatus(const TransferReq &req, TransferStatus &status) {
    ferry_transfer_status now = FERRY_TRANSFER_WAITING;
    ferry_status s = ferry_get_transfer_status(engine_, detail::FromHandle(req), &now);
    if (s != FERRY_OK) return detail::ToStatus(s);
    switch (now) {
      case FERRY_TRANSFER_WAITING: status = TransferStatus::WAITING; return SUCCESS;
      case FERRY_TRANSFER_COMPLETED: status = TransferStatus::COMPLETED; return SUCCESS;
      case FERRY_TRANSFER_TIMEOUT: status = TransferStatus::TIMEOUT; return TIMEOUT;
      default: status = TransferStatus::FAILED; return FAILED;
    }
  }

  Status SendNotify(const AscendString &remote_engine, const NotifyDesc &notify, int32_t timeout_in_millis = 1000) {
    return detail::ToStatus(ferry_notify(engine_, remote_engine.GetString(), notify.name.GetString(),
                                         notify.notify_msg.GetString(), timeout_in_millis));
  }

  /* Drains every notification received. */
  Status GetNotifies(std::vector<NotifyDesc> &notifies) {
    std::vector<ferry_notification> batch(16);
    for (;;) {
      size_t n = 0;
      ferry_status s = ferry_take_notifications(engine_, batch.data(), batch.size(), &n);
      if (s != FERRY_OK) return detail::ToStatus(s);
      for (size_t i = 0; i < n; i++) notifies.push_back(NotifyDesc{batch[i].name, batch[i].msg});
      if (n < batch.size()) return SUCCESS;
    }
  }

  Status MallocMem(MemType type, size_t size, void **ptr) {
    if (ptr == nullptr) return PARAM_INVALID;
    uint64_t h = 0;
    const uint32_t rw = FERRY_ACCESS_READ | FERRY_ACCESS_WRITE;
    return detail::ToStatus(type == MEM_DEVICE ? ferry_alloc_device(engine_, size, rw, ptr, &h)
                                               : ferry_alloc_host(engine_, size, rw, ptr, &h));
  }

  Status FreeMem(void *ptr) { return detail::ToStatus(ferry_free_host(engine_, ptr)); }

  static Status GetCapability(FeatureType feature_type, int32_t &value) {
    return detail::ToStatus(ferry_get_capability(static_cast<int32_t>(feature_type), &value));
  }

  /* ferry's addition: why the last call on this thread failed. */
  static const char *LastError() { return ferry_last_error(); }

 private:
  static uint32_t Op(TransferOp op) { return op == READ ? FERRY_READ : FERRY_WRITE; }
  static std::vector<ferry_op_desc> Descs(const std::vector<TransferOpDesc> &in) {
    std::vector<ferry_op_desc> out;
    out.reserve(in.size());
    for (const auto &d : in) out.push_back(ferry_op_desc{d.local_addr, d.remote_addr, d.len});
    return out;
  }

  uint64_t engine_ = 0;
};

}  // namespace hixl

/* ADXL, HIXL's earlier name for the same engine. */
namespace adxl {
using namespace hixl;
using AdxlEngine = hixl::Hixl;
}  // namespace adxl

#endif
