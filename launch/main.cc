// The kvstream command. Subcommands: demo (for now the CPU attention example).
// Only launch/ reads argv.
#include <iostream>

#include <CLI/CLI.hpp>

#include "attention_example.h"

int main(int argc, char** argv) {
  CLI::App app{"kvstream: layer-wise KV streaming for disaggregated LLM serving"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");

  kvstream::AttentionExampleOptions demo;
  CLI::App* demo_cmd = app.add_subcommand(
      "demo",
      "Run kvstream's attention stack on the CPU: a mixed batch of prefill, chunked prefill "
      "and decode steps through a stack of attention layers over paged caches, checked "
      "against the golden reference");
  demo_cmd->add_option("--layers", demo.num_layers, "Number of attention layers")
      ->capture_default_str()->check(CLI::Range(1, 256));
  demo_cmd->add_option("--heads", demo.num_heads, "Query heads per layer")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  demo_cmd->add_option("--kv-heads", demo.num_kv_heads, "KV heads per layer (divides --heads)")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  demo_cmd->add_option("--head-size", demo.head_size, "Elements per head")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  demo_cmd->add_option("--block-size", demo.block_size, "Tokens per KV-cache block")
      ->capture_default_str()->check(CLI::Range(1, 4096));
  demo_cmd->add_option("--kv-cache-dtype", demo.kv_cache_dtype,
                       "auto, bfloat16, float16, float32, fp8, fp8_e4m3 or fp8_e5m2")
      ->capture_default_str();
  demo_cmd->add_option("--dtype", demo.model_dtype, "Activation dtype: bfloat16, float16, float32")
      ->capture_default_str();
  demo_cmd->add_option("--layout", demo.layout, "KV-cache layout: NHD or HND")->capture_default_str();
  demo_cmd->add_option("--decode-steps", demo.decode_steps, "Decode steps after the prompts")
      ->capture_default_str()->check(CLI::Range(0, 10000));
  demo_cmd->add_option("--seed", demo.seed, "Seed of the synthetic inputs")->capture_default_str();
  demo_cmd->add_option("--tolerance", demo.tolerance,
                       "Largest |fast - reference| accepted on outputs")
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);

  if (demo_cmd->parsed()) {
    absl::Status s = kvstream::RunAttentionExample(demo, std::cout);
    if (!s.ok()) {
      std::cerr << "kvstream demo: FAILED: " << s << "\n";
      return 1;
    }
    std::cout << "kvstream demo: OK\n";
  }
  return 0;
}
