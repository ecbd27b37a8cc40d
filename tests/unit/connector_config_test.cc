// Tests of kv_transfer_config parsing and of layer-name parsing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvstream/connector/config.h"
#include "kvstream/connector/layer_name.h"

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
                                    "secret": "s3", "handshake_timeout_ms": 77}})");
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
  EXPECT_EQ(c->kvstream.secret, "s3");
}

TEST(KvTransferConfigTest, DefaultsAndGeneratedEngineId) {
  auto a = ParseKvTransferConfig("{}");
  auto b = ParseKvTransferConfig("{}");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->kv_role, KvRole::kBoth);
  EXPECT_EQ(a->kv_ip, "127.0.0.1");
  EXPECT_EQ(a->kv_load_failure_policy, LoadFailurePolicy::kRecompute);
  EXPECT_TRUE(a->kvstream.verify_checksum);
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
      {R"({"kv_connector_extra_config": {"transport": "nccl"}})", "nccl"},
      {R"({"kv_connector_extra_config": {"load_timeout_ms": 0}})", "load_timeout_ms"},
      {R"({"kv_connector_extra_config": {"verify_checksum": "yes"}})", "verify_checksum"},
      {R"({"kv_connector_extra_config": []})", "kv_connector_extra_config"},
      {R"({"engine_id": ""})", "engine_id"},
      {R"([1, 2])", "object"},
      {R"({"kv_role": )", "malformed"},
  };
  for (const Case& c : cases) {
    auto r = ParseKvTransferConfig(c.json);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_THAT(r.status().message(), HasSubstr(c.needle)) << c.json;
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
