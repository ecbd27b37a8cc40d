// LayerSender (layer_send.h).
#include "layer_send.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"
#include "layer_notice.h"
#include "layer_runs.h"

namespace kvstream {
namespace internal {
namespace {

std::vector<Segment> ToSegments(const std::vector<ByteRun>& runs) {
  std::vector<Segment> segs;
  segs.reserve(runs.size());
  for (const ByteRun& r : runs) segs.push_back({r.src_offset, r.dst_offset, r.length});
  return segs;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LayerSender>> LayerSender::Create(const LayerTable& table,
                                                                 Transport& transport,
                                                                 bool checksum) {
  std::unique_ptr<LayerSender> s(new LayerSender(transport, checksum));
  if (table.memory() == MemoryKind::kDevice) {
    ASSIGN_OR_RETURN(s->ready_, CudaEvent::Create());
  }
  return s;
}

absl::StatusOr<LayerPost> LayerSender::Post(const LayerEntry& layer, const std::string& request_id,
                                            PeerId peer, const RemoteMemory& k_remote,
                                            const RemoteMemory& v_remote,
                                            absl::Span<const int32_t> local_blocks,
                                            absl::Span<const int32_t> dest_blocks,
                                            int32_t num_tokens, void* stream,
                                            TransferId* posted_k) {
  *posted_k = 0;
  const KvCacheView cv = layer.cache->view();
  ASSIGN_OR_RETURN(LayerRuns runs, PlanLayerRuns(cv, local_blocks, dest_blocks, num_tokens));
  LayerNotice notice;
  notice.request_id = request_id;
  notice.layer = static_cast<uint32_t>(layer.index);
  notice.bytes = runs.bytes;
  WriteOrder order;
  if (cv.memory == MemoryKind::kDevice) {
    if (stream == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", layer.name, "': a device cache's save needs the layer's stream"));
    }
    RETURN_IF_ERROR(ready_.Record(stream));
    order.ready_event = ready_.get();
  } else if (checksum_) {
    notice.checksum_kind = ChecksumKind::kXxh3;
    notice.checksum = HostLayerChecksum(cv, runs, /*destination=*/false);
  }
  notice.post_ns = MonotonicNs();
  ASSIGN_OR_RETURN(std::string payload, EncodeLayerNotice(notice));
  LayerPost post;
  post.bytes = runs.bytes;
  post.post_ns = notice.post_ns;
  ASSIGN_OR_RETURN(post.k, transport_.PostWrite(peer, *layer.k_reg, k_remote, ToSegments(runs.k),
                                                "", order));
  *posted_k = post.k;
  ASSIGN_OR_RETURN(post.v, transport_.PostWrite(peer, *layer.v_reg, v_remote, ToSegments(runs.v),
                                                payload, order));
  return post;
}

}  // namespace internal
}  // namespace kvstream
