// Tests of kv_transfer_config parsing, of layer-name parsing and of the layer ranges of
// pipeline-parallel decode.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/factory.h"
#include "kvstream/connector/layer_name.h"
#include "kvstream/connector/layer_routing.h"
#include "kvstream/transfer/nccl_transport.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

TEST(KvTransferConfigTest, ParsesVllmConfigWithKvstreamSettings) {
  auto c = ParseKvTransferConfig(R"({
      "kv_connector": "LayerwiseConnector", "kv_role": "kv_consumer", "kv_rank": 1,
      "kv_parallel_size": 2, "kv_ip": "10.0.0.7", "kv_port": 20001, "engine_id": "decode-0",
      "kv_buffer_device": "cpu", "kv_buffer_size": 5e9, "kv_load_failure_policy": "fail",
      "kv_connector_module_path": null,
      "kv_connector_extra_config": {"transport": "ucx", "ucx_tls": "tcp",
                                    "ucx_net_devices": "lo", "load_timeout_ms": 250,
                                    "send_timeout_ms": 900, "verify_checksum": false,
                                    "load_async": true,
                                    "secret": "s3", "handshake_timeout_ms": 77,
                                    "ucx_copy_threads": 4, "cuda_device": 3,
                                    "nccl_job_id": "deploy-7",
                                    "nccl_listen_host": "10.0.0.7"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kv_connector, "LayerwiseConnector");
  EXPECT_EQ(c->kv_role, KvRole::kConsumer);
  EXPECT_EQ(c->kv_rank, 1);
  EXPECT_EQ(c->kv_parallel_size, 2);
  EXPECT_EQ(c->kv_ip, "10.0.0.7");
  EXPECT_EQ(c->kv_port, 20001);
  EXPECT_EQ(c->engine_id, "decode-0");
  EXPECT_EQ(c->kv_buffer_size, 5e9);
  EXPECT_EQ(c->kv_load_failure_policy, LoadFailurePolicy::kFail);
  EXPECT_EQ(c->kvstream.ucx_tls, "tcp");
  EXPECT_EQ(c->kvstream.ucx_net_devices, "lo");
  EXPECT_EQ(c->kvstream.load_timeout_ms, 250);
  EXPECT_EQ(c->kvstream.send_timeout_ms, 900);
  EXPECT_EQ(c->kvstream.handshake_timeout_ms, 77);
  EXPECT_FALSE(c->kvstream.verify_checksum);
  EXPECT_TRUE(c->kvstream.load_async);
  EXPECT_EQ(c->kvstream.secret, "s3");
  EXPECT_EQ(c->kvstream.ucx_copy_threads, 4);
  EXPECT_EQ(c->kvstream.transport, "ucx");
  EXPECT_EQ(c->kvstream.cuda_device, 3);
  EXPECT_EQ(c->kvstream.nccl_job_id, "deploy-7");
  EXPECT_EQ(c->kvstream.nccl_listen_host, "10.0.0.7");
}

TEST(KvTransferConfigTest, DefaultsAndGeneratedEngineId) {
  auto a = ParseKvTransferConfig("{}");
  auto b = ParseKvTransferConfig("{}");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->kv_role, KvRole::kBoth);
  EXPECT_EQ(a->kv_ip, "127.0.0.1");
  EXPECT_EQ(a->kv_load_failure_policy, LoadFailurePolicy::kRecompute);
  EXPECT_TRUE(a->kvstream.verify_checksum);
  EXPECT_FALSE(a->kvstream.load_async);
  EXPECT_EQ(a->kvstream.ucx_copy_threads, 0);
  // No transport named: the connector picks one for kv_buffer_device's memory.
  EXPECT_EQ(a->kvstream.transport, "");
  EXPECT_EQ(a->kvstream.cuda_device, 0);
  // The nccl transport's own defaults.
  EXPECT_EQ(a->kvstream.nccl_job_id, NcclTransportOptions{}.job_id);
  EXPECT_EQ(a->kvstream.nccl_listen_host, NcclTransportOptions{}.listen_host);
  EXPECT_FALSE(a->engine_id.empty());
  EXPECT_NE(a->engine_id, b->engine_id);
}

TEST(KvTransferConfigTest, ErrorsNameTheKeyAndValue) {
  struct Case {
    const char* json;
    const char* needle;
  };
  const Case cases[] = {
      {R"({"kv_rol": "kv_consumer"})", "kv_rol"},
      {R"({"kv_role": "decoder"})", "decoder"},
      {R"({"kv_role": 3})", "kv_role"},
      {R"({"kv_port": 70000})", "kv_port"},
      {R"({"kv_port": "80"})", "kv_port"},
      {R"({"kv_rank": 2, "kv_parallel_size": 2})", "kv_rank"},
      {R"({"kv_buffer_device": "tpu"})", "tpu"},
      {R"({"kv_load_failure_policy": "retry"})", "retry"},
      {R"({"kv_connector_extra_config": {"tranport": "ucx"}})", "tranport"},
      {R"({"kv_connector_extra_config": {"transport": "carrier-pigeon"}})", "carrier-pigeon"},
      {R"({"kv_connector_extra_config": {"cuda_device": -1}})", "cuda_device"},
      {R"({"kv_connector_extra_config": {"load_timeout_ms": 0}})", "load_timeout_ms"},
      {R"({"kv_connector_extra_config": {"verify_checksum": "yes"}})", "verify_checksum"},
      {R"({"kv_connector_extra_config": {"ucx_copy_threads": 65}})", "ucx_copy_threads"},
      {R"({"kv_connector_extra_config": {"ucx_copy_threads": -1}})", "ucx_copy_threads"},
      {R"({"kv_connector_extra_config": {"ucx_copy_threads": "4"}})", "ucx_copy_threads"},
      {R"({"kv_connector_extra_config": []})", "kv_connector_extra_config"},
      {R"({"kv_connector_extra_config": {"nccl_job_id": 7}})", "nccl_job_id = 7 is not a string"},
      {R"({"kv_connector_extra_config": {"nccl_listen_host": "node-3"}})",
       "nccl_listen_host = \"node-3\" is not a listen address: host 'node-3' is neither a "
       "numeric IPv4 address nor 'localhost'"},
      {R"({"kv_connector_extra_config": {"nccl_listen_host": ""}})", "nccl_listen_host"},
      {R"({"kv_connector_extra_config": {"nccl_listen_host": "10.0.0.256"}})", "10.0.0.256"},
      {R"({"kv_connector_extra_config": {"nccl_listen_host": ["10.0.0.1"]}})",
       "nccl_listen_host"},
      {R"({"engine_id": ""})", "engine_id"},
      {R"({"kv_connector_extra_config": {"pipeline_parallel_size": 0}})", "pipeline_parallel_size"},
      {R"({"kv_connector_extra_config": {"pipeline_parallel_size": 2, "pipeline_rank": 2}})",
       "pipeline_rank 2 must be below pipeline_parallel_size 2"},
      {R"({"kv_connector_extra_config": {"pipeline_layers": "0-15,x"}})", "\"x\""},
      {R"({"kv_connector_extra_config": {"pipeline_layers": "0-15,12-31"}})", "overlaps stage 0"},
      {R"({"kv_connector_extra_config": {"pipeline_layers": "0-15,17-31"}})",
       "layers 16 are owned by no stage"},
      {R"({"kv_connector_extra_config": {"pipeline_layers": "4-31"}})",
       "layers 0-3 are owned by no stage"},
      {R"({"kv_connector_extra_config": {"pipeline_layers": 7}})", "pipeline_layers"},
      {R"({"kv_connector_extra_config":
           {"pipeline_parallel_size": 3, "pipeline_layers": "0-1,2-3"}})",
       "has 2 stages but pipeline_parallel_size is 3"},
      {R"([1, 2])", "object"},
      {R"({"kv_role": )", "malformed"},
  };
  for (const Case& c : cases) {
    auto r = ParseKvTransferConfig(c.json);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_THAT(r.status().message(), HasSubstr(c.needle)) << c.json;
  }
}

TEST(KvTransferConfigTest, NcclJobIdIsBoundedAsTheTransportBoundsIt) {
  const std::string at_limit(256, 'j');
  auto ok = ParseKvTransferConfig(absl::StrCat(
      R"({"kv_connector_extra_config": {"nccl_job_id": ")", at_limit, R"("}})"));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->kvstream.nccl_job_id, at_limit);
  auto over = ParseKvTransferConfig(absl::StrCat(
      R"({"kv_connector_extra_config": {"nccl_job_id": ")", at_limit, R"(j"}})"));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(over.status().message(), HasSubstr("nccl_job_id"));
  EXPECT_THAT(over.status().message(), HasSubstr("257 bytes, more than 256"));
}

TEST(KvTransferConfigTest, WorkerTransportOptionsCarryEveryTransportSetting) {
  auto c = ParseKvTransferConfig(R"({"engine_id": "decode-3", "kv_buffer_device": "cuda",
      "kv_connector_extra_config": {"transport": "ucx", "cuda_device": 2,
                                    "nccl_job_id": "deploy-7", "nccl_listen_host": "10.1.2.3",
                                    "ucx_tls": "tcp", "ucx_net_devices": "eth0",
                                    "ucx_copy_threads": 3}})");
  ASSERT_TRUE(c.ok()) << c.status();
  const TransportOptions o = WorkerTransportOptions(*c);
  EXPECT_EQ(o.name, "ucx");
  EXPECT_EQ(o.cuda_device, 2);
  EXPECT_EQ(o.nccl_job_id, "deploy-7");
  EXPECT_EQ(o.nccl_listen_host, "10.1.2.3");
  EXPECT_EQ(o.ucx_tls, "tcp");
  EXPECT_EQ(o.ucx_net_devices, "eth0");
  EXPECT_EQ(o.ucx_copy_threads, 3);
  EXPECT_EQ(o.loopback_name, "decode-3");
  // Unset: the transport's defaults, and the default transport of the cache's memory.
  auto d = ParseKvTransferConfig(R"({"kv_buffer_device": "cuda"})");
  ASSERT_TRUE(d.ok()) << d.status();
  const TransportOptions p = WorkerTransportOptions(*d);
  EXPECT_EQ(p.name, DefaultTransportName(MemoryKind::kDevice));
  EXPECT_EQ(p.nccl_job_id, TransportOptions{}.nccl_job_id);
  EXPECT_EQ(p.nccl_listen_host, TransportOptions{}.nccl_listen_host);
}

TEST(KvTransferConfigTest, PipelineKeys) {
  auto c = ParseKvTransferConfig(R"({"kv_role": "kv_consumer", "kv_connector_extra_config":
      {"pipeline_parallel_size": 2, "pipeline_rank": 1, "pipeline_layers": "0-19,20-31"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kvstream.pipeline_parallel_size, 2);
  EXPECT_EQ(c->kvstream.pipeline_rank, 1);
  ASSERT_EQ(c->kvstream.pipeline_layers.size(), 2u);
  EXPECT_EQ(c->kvstream.pipeline_layers[1], (LayerRange{20, 32}));
  // pipeline_layers alone gives the number of stages.
  auto d = ParseKvTransferConfig(R"({"kv_connector_extra_config":
      {"pipeline_layers": "0-9,10-19,20-31", "pipeline_rank": 2}})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kvstream.pipeline_parallel_size, 3);
  auto e = ParseKvTransferConfig("{}");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->kvstream.pipeline_parallel_size, 1);
  EXPECT_EQ(e->kvstream.pipeline_rank, 0);
  EXPECT_TRUE(e->kvstream.pipeline_layers.empty());
}

TEST(KvTransferConfigTest, PipelineGroupAndPeerBounds) {
  auto c = ParseKvTransferConfig(R"({"engine_id": "decode0-pp1", "kv_connector_extra_config":
      {"pipeline_parallel_size": 2, "pipeline_rank": 1, "max_connections": 8,
       "max_requests_per_consumer": 3, "max_tokens_per_consumer": 4096}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kvstream.max_connections, 8);
  EXPECT_EQ(c->kvstream.max_requests_per_consumer, 3);
  EXPECT_EQ(c->kvstream.max_tokens_per_consumer, 4096);
  // The stages of a group "decode0" are named "decode0-pp<rank>" by the launcher.
  EXPECT_EQ(PipelineGroup(*c), "decode0");
  c->kvstream.pipeline_group = "group-a";
  EXPECT_EQ(PipelineGroup(*c), "group-a");
  c->kvstream.pipeline_group.clear();
  c->engine_id = "decode-pp";  // no rank digits: the id as it is
  EXPECT_EQ(PipelineGroup(*c), "decode-pp");
  c->engine_id = "-pp1";  // nothing before the suffix
  EXPECT_EQ(PipelineGroup(*c), "-pp1");
  c->kvstream.pipeline_parallel_size = 1;  // no pipeline: no group
  EXPECT_EQ(PipelineGroup(*c), "");
  auto defaults = ParseKvTransferConfig("{}");
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->kvstream.max_connections, 256);
  EXPECT_EQ(defaults->kvstream.max_requests_per_consumer, 1024);
  EXPECT_EQ(defaults->kvstream.max_tokens_per_consumer, int64_t{1} << 22);
  for (const char* bad : {R"({"kv_connector_extra_config": {"max_connections": 0}})",
                          R"({"kv_connector_extra_config": {"max_requests_per_consumer": -1}})",
                          R"({"kv_connector_extra_config": {"max_tokens_per_consumer": 0}})"}) {
    EXPECT_EQ(ParseKvTransferConfig(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(KvTransferConfigTest, ReconnectBackoff) {
  auto defaults = ParseKvTransferConfig("{}");
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->kvstream.reconnect_backoff_ms, 200);
  EXPECT_EQ(defaults->kvstream.reconnect_backoff_max_ms, 5000);
  auto c = ParseKvTransferConfig(R"({"kv_connector_extra_config":
      {"reconnect_backoff_ms": 0, "reconnect_backoff_max_ms": 0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kvstream.reconnect_backoff_ms, 0);
  EXPECT_EQ(c->kvstream.reconnect_backoff_max_ms, 0);
  for (const char* bad :
       {R"({"kv_connector_extra_config": {"reconnect_backoff_ms": -1}})",
        R"({"kv_connector_extra_config": {"reconnect_backoff_ms": 6000}})",  // above the max
        R"({"kv_connector_extra_config": {"reconnect_backoff_ms": 10, "reconnect_backoff_max_ms": 5}})"}) {
    auto r = ParseKvTransferConfig(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  auto message = ParseKvTransferConfig(
      R"({"kv_connector_extra_config": {"reconnect_backoff_ms": 10, "reconnect_backoff_max_ms": 5}})");
  EXPECT_THAT(message.status().message(), HasSubstr("reconnect_backoff_max_ms 5"));
}

// Deep nesting is refused with an error, not a stack overflow: 60,000 levels inside a known
// key and at the top, in arrays and objects; 64 levels are still parsed (and then refused
// for what they are, a value of the wrong type).
TEST(KvTransferConfigTest, DeepNestingIsAnError) {
  const int kDeep = 60000;
  std::string arrays = R"({"kv_connector_extra_config": {"transport": )";
  arrays += std::string(kDeep, '[') + std::string(kDeep, ']') + "}}";
  std::string objects;
  for (int i = 0; i < kDeep; ++i) objects += R"({"a":)";
  objects += "1" + std::string(kDeep, '}');
  std::string unterminated(kDeep, '[');
  for (const std::string* text : {&arrays, &objects, &unterminated}) {
    auto r = ParseKvTransferConfig(*text);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("nested deeper than 64 levels"));
  }
  std::string shallow = R"({"kv_connector_extra_config": {"transport": )";
  shallow += std::string(kMaxConfigDepth - 2, '[') + std::string(kMaxConfigDepth - 2, ']') + "}}";
  auto r = ParseKvTransferConfig(shallow);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("is not a string"));
}

TEST(PipelineStageLayersTest, EvenSplitExplicitPartitionAndErrors) {
  KvstreamSettings s;
  EXPECT_EQ(*PipelineStageLayers(s, 32), (LayerRange{0, 32}));  // no pipeline: every layer
  s.pipeline_parallel_size = 2;
  s.pipeline_rank = 1;
  EXPECT_EQ(*PipelineStageLayers(s, 32), (LayerRange{16, 32}));
  EXPECT_EQ(*PipelineStageLayers(s, 5), (LayerRange{3, 5}));
  EXPECT_EQ(PipelineStageLayers(s, 1).status().code(), absl::StatusCode::kInvalidArgument);
  s.pipeline_layers = *ParseLayerRanges("0-19,20-31");
  EXPECT_EQ(*PipelineStageLayers(s, 32), (LayerRange{20, 32}));
  auto short_model = PipelineStageLayers(s, 24);
  EXPECT_EQ(short_model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_model.status().message(), HasSubstr("the model has 24 layers"));
  auto long_model = PipelineStageLayers(s, 40);
  EXPECT_THAT(long_model.status().message(), HasSubstr("leave layers 32-39"));
  EXPECT_THAT(long_model.status().message(), HasSubstr("owned by no decode stage"));
}

TEST(LayerRangesTest, ParseAndFormat) {
  auto r = ParseLayerRanges("0-15,16-31");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (std::vector<LayerRange>{{0, 16}, {16, 32}}));
  EXPECT_EQ(FormatLayerRanges(*r), "0-15,16-31");
  auto single = ParseLayerRanges(" 7 , 8-9 ");
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(*single, (std::vector<LayerRange>{{7, 8}, {8, 10}}));
  EXPECT_EQ(FormatLayerRanges(*single), "7,8-9");
  for (const char* bad :
       {"", " ", "a-b", "5-3", "-1", "1-", "1,,2", "0-15;16-31", "+3", "99999999"}) {
    auto p = ParseLayerRanges(bad);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(ParseLayerRanges("0-3,9-5").status().message(), HasSubstr("9-5"));
  EXPECT_EQ(FormatLayerSet({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatLayerSet({}), "none");
}

TEST(LayerRangesTest, PipelinePartitions) {
  EXPECT_TRUE(ValidatePipelinePartition({{0, 16}, {16, 32}}).ok());
  EXPECT_TRUE(ValidatePipelinePartition({{0, 1}}).ok());
  EXPECT_THAT(ValidatePipelinePartition({{0, 16}, {15, 32}}).message(),
              HasSubstr("stage 1 (layers 15-31) overlaps stage 0 (layers 0-15)"));
  EXPECT_THAT(ValidatePipelinePartition({{0, 16}, {18, 32}}).message(),
              HasSubstr("layers 16-17 are owned by no stage"));
  EXPECT_THAT(ValidatePipelinePartition({{2, 16}}).message(),
              HasSubstr("layers 0-1 are owned by no stage"));
  EXPECT_EQ(ValidatePipelinePartition({}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidatePipelinePartition({{0, 4}, {4, 4}}).code(), absl::StatusCode::kInvalidArgument);
  // vLLM's even split: the remainder goes to the stages before the last.
  EXPECT_EQ(*EvenPipelinePartition(32, 2), (std::vector<LayerRange>{{0, 16}, {16, 32}}));
  EXPECT_EQ(*EvenPipelinePartition(10, 4),
            (std::vector<LayerRange>{{0, 2}, {2, 5}, {5, 8}, {8, 10}}));
  EXPECT_EQ(*EvenPipelinePartition(4, 1), (std::vector<LayerRange>{{0, 4}}));
  EXPECT_EQ(EvenPipelinePartition(3, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EvenPipelinePartition(3, 0).status().code(), absl::StatusCode::kInvalidArgument);
  for (int stages = 1; stages <= 7; ++stages) {
    EXPECT_TRUE(ValidatePipelinePartition(*EvenPipelinePartition(31, stages)).ok()) << stages;
  }
}

TEST(LayerNameTest, ExactlyOneInteger) {
  EXPECT_EQ(*ParseLayerIndex("model.layers.12.self_attn.attn"), 12);
  EXPECT_EQ(*ParseLayerIndex("layers.0"), 0);
  EXPECT_EQ(*ParseLayerIndex("decoder.block7.attn"), 7);
  for (const char* bad : {"model.attn", "model.layers.1.experts.2.attn", "",
                          "layers.99999999999999999999"}) {
    auto r = ParseLayerIndex(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(ParseLayerIndex("model.attn").status().message(), HasSubstr("model.attn"));
}

}  // namespace
}  // namespace kvstream
