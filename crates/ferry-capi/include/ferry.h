/* ferry's C ABI. Generated from crates/ferry-capi by cbindgen: do not edit (run
 * `FERRY_BLESS=1 cargo test -p ferry-capi --test header` after changing the Rust code).
 *
 * Handles (engines, registrations, requests) are uint64_t numbers naming entries of the library's
 * tables: 0 is never one, and a handle used after it was destroyed is refused with
 * FERRY_INVALID_HANDLE instead of touching freed memory. The library owns what a handle names and
 * frees it at the matching destroy call. Every function returns a ferry_status; on failure,
 * ferry_last_error() says what went wrong (per thread). No function lets a panic escape. */

#ifndef FERRY_H
#define FERRY_H



#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

// Peers may read a registered region.
#define FERRY_ACCESS_READ 1

// Peers may write a registered region.
#define FERRY_ACCESS_WRITE 2

// Most bytes of a notification's name or message (1024 characters of UTF-8).
#define FERRY_NOTIFY_MAX_BYTES 4096

// The size of a notification's name and message fields: the most bytes and a NUL.
#define FERRY_NOTIFY_FIELD 4097

// Most descriptors one transfer may carry.
#define FERRY_MAX_DESCS (1 << 20)

// What a call returned. The values of ferry's error codes 1 to 12, then `FERRY_INVALID_HANDLE`,
// then `FERRY_INTEGRITY` (ferry's code 13, which came after the handle code).
typedef enum {
  // Done.
  FERRY_OK = 0,
  // An argument was wrong: null, out of range, malformed.
  FERRY_INVALID_ARGUMENT = 1,
  // The operation did not finish in time.
  FERRY_TIMEOUT = 2,
  // No link to that remote engine: connect first.
  FERRY_NOT_CONNECTED = 3,
  // A link to that remote engine exists already.
  FERRY_ALREADY_CONNECTED = 4,
  // A limit was reached (links, pending notifications, memory).
  FERRY_RESOURCE_EXHAUSTED = 5,
  // Not supported by this build or this peer.
  FERRY_UNSUPPORTED = 6,
  // The peer may not do that (an authenticated engine's grants).
  FERRY_PERMISSION_DENIED = 7,
  // An address range outside every registered region.
  FERRY_OUT_OF_BOUNDS = 8,
  // The peer closed the link.
  FERRY_PEER_CLOSED = 9,
  // The peer broke the protocol.
  FERRY_PROTOCOL = 10,
  // An operating-system error.
  FERRY_IO = 11,
  // A bug in ferry (a caught panic among them).
  FERRY_INTERNAL = 12,
  // A handle that was never issued, or was destroyed already.
  FERRY_INVALID_HANDLE = 13,
  // A transfer that asked for integrity found the destination's bytes differ from the source's;
  // retry it.
  FERRY_INTEGRITY = 14,
} ferry_status;

// Where an asynchronous transfer stands.
typedef enum {
  FERRY_TRANSFER_WAITING = 0,
  FERRY_TRANSFER_COMPLETED = 1,
  FERRY_TRANSFER_TIMEOUT = 2,
  FERRY_TRANSFER_FAILED = 3,
} ferry_transfer_status;

// A transfer's direction.
typedef enum {
  // Remote memory into local memory.
  FERRY_READ = 0,
  // Local memory into remote memory.
  FERRY_WRITE = 1,
} ferry_op;

// What [`ferry_get_capability`] can be asked about.
typedef enum {
  // TCP as a data path.
  FERRY_FEATURE_TCP = 0,
  // Same-host shared memory.
  FERRY_FEATURE_SHM = 1,
  // RDMA verbs (compiled in and a device usable here).
  FERRY_FEATURE_RDMA = 2,
  // Notifications between engines.
  FERRY_FEATURE_NOTIFY = 3,
  // Asynchronous transfers with status.
  FERRY_FEATURE_ASYNC_TRANSFER = 4,
  // Engines that listen (client/server).
  FERRY_FEATURE_LISTEN = 5,
} ferry_feature;

// How an engine is made. Zero it (or call [`ferry_engine_options_init`]) and set what you need;
// every string is optional (null).
typedef struct {
  // Address to listen on, `"ip:port"` (port 0: any free port); null: do not listen.
  const char *listen;
  // Transports to offer, comma-separated (`"tcp,shm,rdma"`); null: all this build has.
  const char *transports;
  // TCP streams per link; 0: the default.
  uint32_t streams;
  // Staging buffer pool, `"BUFFER_NUM:BUFFER_SIZE_MB"` (`"0:0"`: none); null: the default.
  const char *buffer_pool;
  // Mutual TLS: this engine's certificate chain, key and the CA roots (PEM files); all three or none.
  const char *tls_cert;
  const char *tls_key;
  const char *tls_ca;
  // RDMA traffic class (0..=255, a multiple of 4); -1: the default (132). Zeroing the struct
  // asks for 0: call [`ferry_engine_options_init`] for the defaults.
  int32_t rdma_traffic_class;
  // RDMA service level (0..=7); -1: the default (4).
  int32_t rdma_service_level;
} ferry_engine_options;

// One piece of a transfer: `len` bytes between a local and a remote address.
typedef struct {
  uint64_t local_addr;
  uint64_t remote_addr;
  uint64_t len;
} ferry_op_desc;

// A notification received, copied out: NUL-terminated UTF-8.
typedef struct {
  // The sender's engine id, as it claimed it.
  uint64_t from_engine;
  char name[FERRY_NOTIFY_FIELD];
  char msg[FERRY_NOTIFY_FIELD];
} ferry_notification;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The message of the last call on this thread that did not return `FERRY_OK`: a NUL-terminated
// string owned by the library, valid until the next failing call on this thread. Never null.
const char *ferry_last_error(void);

// Sets `options` to the defaults: no listening, every transport, default streams and pool, no TLS,
// default RDMA traffic class and service level.
//
// # Safety
// `options` points to a writable `ferry_engine_options`.
ferry_status ferry_engine_options_init(ferry_engine_options *options);

// Makes an engine (HIXL `Initialize`). `options` may be null (the defaults). On success `*engine`
// is its handle, to be destroyed with [`ferry_engine_destroy`].
//
// # Safety
// `options` is null or points to a `ferry_engine_options` whose strings are null or NUL-terminated;
// `engine` points to a writable `uint64_t`.
ferry_status ferry_engine_create(const ferry_engine_options *options, uint64_t *engine);

// Destroys an engine (HIXL `Finalize`): closes its links, deregisters and frees what it holds. The
// handle, and every registration and request of the engine, is invalid afterwards.
ferry_status ferry_engine_destroy(uint64_t engine);

// Writes the address the engine listens on (`"ip:port"`, NUL-terminated) into `buf` of `cap` bytes;
// `*needed` (if not null) gets the size it takes. `FERRY_UNSUPPORTED` if it does not listen.
//
// # Safety
// `buf` points to `cap` writable bytes; `needed` is null or a writable `size_t`.
ferry_status ferry_engine_local_addr(uint64_t engine, char *buf, size_t cap, size_t *needed);

// Registers `len` bytes of the caller's memory at `ptr` (HIXL `RegisterMem`); `*mem` gets the
// registration's handle. The memory stays the caller's: it must stay valid, and must not be freed,
// until [`ferry_deregister`] has returned.
//
// # Safety
// `ptr..ptr+len` is memory of this process that stays valid until the registration is removed;
// `mem` points to a writable `uint64_t`.
ferry_status ferry_register(uint64_t engine,
                            void *ptr,
                            size_t len,
                            uint32_t access_bits,
                            uint64_t *mem);

// Allocates `len` bytes of host memory, zeroed, and registers them (HIXL `MallocMem`): `*ptr` gets
// the memory and `*mem` the registration. The memory is the library's: it is freed by
// [`ferry_deregister`] (or [`ferry_free_host`]) and must not be used afterwards.
//
// # Safety
// `ptr` and `mem` point to writable storage.
ferry_status ferry_alloc_host(uint64_t engine,
                              size_t len,
                              uint32_t access_bits,
                              void **ptr,
                              uint64_t *mem);

// Registers `len` bytes of CUDA device memory at the device address `ptr` (HIXL `RegisterMem` with
// `MEM_DEVICE`); `*mem` gets the registration's handle. The CUDA driver must know the range as one
// allocation of device memory in its device's primary context (the runtime API's, where
// `cudaMalloc` allocates); descriptors name it by its device address, and its bytes move through a
// pinned host copy. `FERRY_UNSUPPORTED` without a CUDA driver, `FERRY_INVALID_ARGUMENT` for memory
// that is not such an allocation.
//
// # Safety
// `ptr..ptr+len` is device memory that stays allocated until the registration is removed; `mem`
// points to a writable `uint64_t`.
ferry_status ferry_register_device(uint64_t engine,
                                   void *ptr,
                                   size_t len,
                                   uint32_t access_bits,
                                   uint64_t *mem);

// Allocates `len` bytes of device memory, zeroed, on CUDA device 0 (as `CUDA_VISIBLE_DEVICES`
// numbers them) and registers them (HIXL `MallocMem` with `MEM_DEVICE`): `*ptr` gets the device
// address and `*mem` the registration. Freed by [`ferry_deregister`] or [`ferry_free_host`].
// `FERRY_UNSUPPORTED` without a CUDA driver or device.
//
// # Safety
// `ptr` and `mem` point to writable storage.
ferry_status ferry_alloc_device(uint64_t engine,
                                size_t len,
                                uint32_t access_bits,
                                void **ptr,
                                uint64_t *mem);

// Removes a registration (HIXL `DeregisterMem`); memory from [`ferry_alloc_host`] is freed with it.
// Returns once no transfer touches the memory any more.
ferry_status ferry_deregister(uint64_t engine, uint64_t mem);

// Frees memory [`ferry_alloc_host`] or [`ferry_alloc_device`] returned, by its pointer (HIXL
// `FreeMem`).
ferry_status ferry_free_host(uint64_t engine, void *ptr);

// Links to the engine listening at `remote` (`"ip:port"`, HIXL `Connect`). Later calls name the
// link by the same string.
//
// # Safety
// `remote` is a NUL-terminated string.
ferry_status ferry_connect(uint64_t engine, const char *remote, int32_t timeout_ms);

// Closes the link to `remote` (HIXL `Disconnect`).
//
// # Safety
// `remote` is a NUL-terminated string.
ferry_status ferry_disconnect(uint64_t engine, const char *remote, int32_t timeout_ms);

// Moves the bytes `descs` describe and returns when every one is at its destination (HIXL
// `TransferSync`); `operation` is a `ferry_op`. Every local address must lie in a registration of this engine, every remote one
// in a region the remote engine registered.
//
// # Safety
// `remote` is a NUL-terminated string; `descs` points to `count` readable descriptors.
ferry_status ferry_transfer_sync(uint64_t engine,
                                 const char *remote,
                                 uint32_t operation,
                                 const ferry_op_desc *descs,
                                 size_t count,
                                 int32_t timeout_ms);

// Starts a transfer and returns at once (HIXL `TransferAsync`): `*request` gets its handle, to
// query with [`ferry_get_transfer_status`]. The descriptors are checked before this returns.
//
// # Safety
// As [`ferry_transfer_sync`]; `request` points to a writable `uint64_t`.
ferry_status ferry_transfer_async(uint64_t engine,
                                  const char *remote,
                                  uint32_t operation,
                                  const ferry_op_desc *descs,
                                  size_t count,
                                  int32_t timeout_ms,
                                  uint64_t *request);

// Where an asynchronous transfer stands (HIXL `GetTransferStatus`). Once it reports
// `COMPLETED`, `TIMEOUT` or `FAILED` the request is released: its handle is invalid afterwards.
// A failed transfer's reason is in [`crate::ferry_last_error`] after the call that reports it.
//
// # Safety
// `status` points to a writable `ferry_transfer_status`.
ferry_status ferry_get_transfer_status(uint64_t engine,
                                       uint64_t request,
                                       ferry_transfer_status *status);

// Sends `{name, msg}` to `remote`'s notification queue (HIXL `SendNotify`); each at most
// [`FERRY_NOTIFY_MAX_BYTES`] bytes (1024 characters).
//
// # Safety
// `remote`, `name` and `msg` are NUL-terminated strings.
ferry_status ferry_notify(uint64_t engine,
                          const char *remote,
                          const char *name,
                          const char *msg,
                          int32_t timeout_ms);

// Moves up to `cap` received notifications into `out` (HIXL `GetNotifies`); `*taken` gets how many.
// Those that did not fit stay for the next call.
//
// # Safety
// `out` points to `cap` writable `ferry_notification`s; `taken` to a writable `size_t`.
ferry_status ferry_take_notifications(uint64_t engine,
                                      ferry_notification *out,
                                      size_t cap,
                                      size_t *taken);

// Whether this build and host support `feature` (a `ferry_feature`; HIXL `GetCapability`): `*value`
// is 1 or 0. Callable before any engine exists. `FERRY_UNSUPPORTED` for a feature this build does
// not know, `FERRY_INVALID_ARGUMENT` for a negative one.
//
// # Safety
// `value` points to a writable `int32_t`.
ferry_status ferry_get_capability(int32_t feature, int32_t *value);

// Writes what this build and host can do (transports and why, devices), as JSON, into `buf` of
// `cap` bytes; `*needed` (if not null) gets the size it takes, so a first call with `cap` 0 sizes it.
//
// # Safety
// `buf` points to `cap` writable bytes (or is null with `cap` 0); `needed` is null or writable.
ferry_status ferry_capabilities_json(char *buf,
                                     size_t cap,
                                     size_t *needed);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* FERRY_H */
