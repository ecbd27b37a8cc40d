// Move-only owners of UCX handles (private to transfer/): config, context, worker, memory
// handle, remote key and endpoint. Each releases its handle exactly once, on destruction or
// Reset(). None of them locks: the UCX transport calls them with its mutex held, as it does
// every other UCX call (see ucx_transport.cc).
#ifndef KVSTREAM_TRANSFER_SRC_UCX_UCX_HANDLES_H_
#define KVSTREAM_TRANSFER_SRC_UCX_UCX_HANDLES_H_

#include <ucp/api/ucp.h>

#include <utility>

namespace kvstream {
namespace internal {

// Owns `Handle` (a UCX pointer type); Release(owner, handle) frees it. Owner is the object
// the release call needs besides the handle (the context for a memory handle), or a dummy.
template <typename Handle, typename Owner, void (*Release)(Owner, Handle)>
class UcxHandle {
 public:
  UcxHandle() = default;
  UcxHandle(Owner owner, Handle handle) : owner_(owner), handle_(handle) {}
  ~UcxHandle() { Reset(); }
  UcxHandle(UcxHandle&& other) noexcept
      : owner_(other.owner_), handle_(std::exchange(other.handle_, nullptr)) {}
  UcxHandle& operator=(UcxHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      owner_ = other.owner_;
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  UcxHandle(const UcxHandle&) = delete;
  UcxHandle& operator=(const UcxHandle&) = delete;

  Handle get() const { return handle_; }
  explicit operator bool() const { return handle_ != nullptr; }
  void Reset() {
    if (handle_ != nullptr) Release(owner_, std::exchange(handle_, nullptr));
  }

 private:
  Owner owner_{};
  Handle handle_ = nullptr;
};

struct NoOwner {};

inline void ReleaseConfig(NoOwner, ucp_config_t* config) { ucp_config_release(config); }
inline void ReleaseContext(NoOwner, ucp_context_h context) { ucp_cleanup(context); }
inline void ReleaseWorker(NoOwner, ucp_worker_h worker) { ucp_worker_destroy(worker); }
inline void ReleaseMemHandle(ucp_context_h context, ucp_mem_h memh) {
  ucp_mem_unmap(context, memh);  // cannot fail for a handle ucp_mem_map returned
}
inline void ReleaseRkey(NoOwner, ucp_rkey_h rkey) { ucp_rkey_destroy(rkey); }

using UcxConfig = UcxHandle<ucp_config_t*, NoOwner, ReleaseConfig>;
using UcxContext = UcxHandle<ucp_context_h, NoOwner, ReleaseContext>;
using UcxWorker = UcxHandle<ucp_worker_h, NoOwner, ReleaseWorker>;
using UcxMemHandle = UcxHandle<ucp_mem_h, ucp_context_h, ReleaseMemHandle>;
using UcxRkey = UcxHandle<ucp_rkey_h, NoOwner, ReleaseRkey>;

// An endpoint. Closing one is asynchronous in UCX, so besides the destructor (a forced
// close, waited for by progressing the worker) it offers StartClose() for callers that
// progress the close themselves without blocking.
class UcxEndpoint {
 public:
  UcxEndpoint() = default;
  UcxEndpoint(ucp_worker_h worker, ucp_ep_h ep) : worker_(worker), ep_(ep) {}
  ~UcxEndpoint() { CloseNow(); }
  UcxEndpoint(UcxEndpoint&& other) noexcept
      : worker_(other.worker_), ep_(std::exchange(other.ep_, nullptr)) {}
  UcxEndpoint& operator=(UcxEndpoint&& other) noexcept {
    if (this != &other) {
      CloseNow();
      worker_ = other.worker_;
      ep_ = std::exchange(other.ep_, nullptr);
    }
    return *this;
  }
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;

  ucp_ep_h get() const { return ep_; }
  explicit operator bool() const { return ep_ != nullptr; }

  // Starts closing the endpoint and gives up ownership of it. `force` skips flushing
  // outstanding operations (required after a peer error; their requests complete with an
  // error). Returns the close request, which the caller polls with ucp_request_check_status
  // and frees with ucp_request_free, or nullptr when the close completed (or failed, which
  // leaves nothing to wait for) at once.
  void* StartClose(bool force);

 private:
  // A forced close, progressing the worker until it completes. Bounded: a forced close
  // needs nothing from the peer.
  void CloseNow();

  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_HANDLES_H_
