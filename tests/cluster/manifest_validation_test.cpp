// The node manifest: the committed example parses to what it says, and
// every kind of mistake is reported with its line and key, all at once.
#include "cluster/manifest.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "../temp_path.hpp"

namespace troupe::cluster {
namespace {

const char* good = R"(# a comment
[cluster]
name = "lab"
head = "a"
certs = "certs"

[model]
path = "models/tiny"
quant = "q8_0"
kv_type = "f16"
ctx = 4096
overrides = { "vision.*" = "int8", "layers.0.*" = "f16" }

[parallelism]
pipeline_stages = 2
tensor_parallel = 1

[scheduler]
queue_limit = 32
max_running = 8
stream_idle_s = 2.5

[transport]
tls = "tcp"
timeout_ms = 5000

[[nodes]]
name = "a"
host = "127.0.0.1"
port = 7400
devices = [{ type = "cpu", cores = "0-1", memory = "2GiB" }]

[[nodes]]
name = "b"
host = "10.0.0.2"
port = 7400
model_path = "/srv/models/tiny"
devices = [{ type = "cuda", index = 1, memory = 1073741824 }, { type = "cpu", cores = 3 }]
)";

std::string joined(const manifest_error& e) {
  return e.text();
}

TEST(Manifest, PlacementKeys) {
  const std::string text =
      "[cluster]\nname = \"x\"\nhead = \"a\"\ncerts = \"c\"\n"
      "[placement]\nwait_for_nodes_s = 2.5\nrebalance = false\ninterval_s = 1\ngain_threshold = "
      "0.3\n"
      "cooldown_s = 120\nmemory_pressure = 0.8\nmeasure_s = 40\nload_half_life_s = 0\n"
      "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = \"cpu\" "
      "}]\n";
  auto m = parse_manifest(text, "/tmp/m.toml");
  ASSERT_TRUE(m) << joined(m.error());
  EXPECT_EQ(m->placement.wait_for_nodes_s, 2.5);
  EXPECT_FALSE(m->placement.rebalance);
  EXPECT_EQ(m->placement.interval_s, 1);
  EXPECT_EQ(m->placement.gain_threshold, 0.3);
  EXPECT_EQ(m->placement.cooldown_s, 120);
  EXPECT_EQ(m->placement.memory_pressure, 0.8);
  EXPECT_EQ(m->placement.measure_s, 40);
  EXPECT_EQ(m->placement.load_half_life_s, 0);
}

TEST(Manifest, ParsesEveryField) {
  auto m = parse_manifest(good, "/etc/troupe/lab.toml");
  ASSERT_TRUE(m) << joined(m.error());
  EXPECT_EQ(m->name, "lab");
  EXPECT_EQ(m->head, "a");
  EXPECT_EQ(m->certs_dir, "/etc/troupe/certs");
  EXPECT_EQ(m->model.quant, "q8_0");
  EXPECT_EQ(m->model.kv_type, "f16");
  EXPECT_EQ(m->model.ctx_tokens, 4096);
  ASSERT_EQ(m->model.overrides.size(), 2u);
  EXPECT_EQ(m->parallelism.pipeline_stages, 2);
  // [placement] absent: the documented defaults.
  EXPECT_EQ(m->placement.wait_for_nodes_s, 60);
  EXPECT_TRUE(m->placement.rebalance);
  EXPECT_EQ(m->placement.gain_threshold, 0.15);
  EXPECT_EQ(m->placement.cooldown_s, 60);
  EXPECT_EQ(m->scheduler.queue_limit, 32);
  EXPECT_EQ(m->scheduler.max_running, 8);
  EXPECT_EQ(m->scheduler.token_budget, 512);  // default
  EXPECT_EQ(m->scheduler.stream_idle_s, 2.5);
  EXPECT_EQ(m->transport.tls, "tcp");
  EXPECT_EQ(m->transport.timeout_ms, 5000);
  ASSERT_EQ(m->nodes.size(), 2u);
  const auto& a = m->head_node();
  EXPECT_EQ(a.port, 7400);
  ASSERT_EQ(a.devices.size(), 1u);
  EXPECT_EQ(a.devices[0].spec(), "cpu:0-1");
  EXPECT_EQ(a.devices[0].memory_bytes, 2ull << 30);
  EXPECT_EQ(a.line, 27);
  const auto* b = m->node("b");
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(b->devices.size(), 2u);
  EXPECT_EQ(b->devices[0].spec(), "cuda:1");
  EXPECT_EQ(b->devices[0].memory_bytes, 1ull << 30);
  EXPECT_EQ(b->devices[1].spec(), "cpu:3");
  EXPECT_EQ(m->model_path_of(a), "/etc/troupe/models/tiny");
  EXPECT_EQ(m->model_path_of(*b), "/srv/models/tiny");
  EXPECT_TRUE(is_loopback(a.host));
  EXPECT_FALSE(is_loopback(b->host));
}

TEST(Manifest, TheCommittedExampleIsValid) {
  auto m = load_manifest(std::string(TROUPE_FIXTURES_DIR) + "/../../examples/local.toml");
  ASSERT_TRUE(m) << joined(m.error());
  EXPECT_EQ(m->nodes.size(), 3u);
  for (const auto& n : m->nodes) EXPECT_TRUE(is_loopback(n.host)) << n.name;
  EXPECT_NE(m->node(m->head), nullptr);
  EXPECT_EQ(m->model.path, "bundled");
}

// Each mistake: the line it is on and the key named in the message.
struct bad_case {
  std::string text;
  std::string expect;  // substring of one message
};

TEST(Manifest, EveryMistakeIsReportedWithItsLineAndKey) {
  const std::string head = "[cluster]\nname = \"x\"\nhead = \"a\"\ncerts = \"c\"\n";  // lines 1-4
  const std::string node =
      "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = \"cpu\" "
      "}]\n";
  const std::vector<bad_case> cases{
      {head + "colour = 3\n" + node, "m.toml:5: cluster.colour: unknown key"},
      {head + node + "[scheduler]\nqueue_limit = 0\n",
       "m.toml:11: scheduler.queue_limit: must be in [1, "},
      {head + node + "[scheduler]\nqueue_limit = \"many\"\n",
       "m.toml:11: scheduler.queue_limit: expected an integer"},
      {head + node + "[scheduler]\nstream_idle_s = 0\n",
       "m.toml:11: scheduler.stream_idle_s: must be in [0.1, "},
      {head + node + "[kv]\nhost_tokens = -1\n", "m.toml:11: kv.host_tokens: must be in [0, "},
      {head + node + "[kv]\nswap = 4\n", "m.toml:11: kv.swap: unknown key"},
      {head + node + "[kv]\nhost_tokens = 8\n",
       "m.toml:11: kv.host_tokens: holds no KV block of 16 tokens"},
      {head + node + "[kv]\ndisk_dir = \"/var/tmp\"\n",
       "m.toml:11: kv.disk_dir: set without kv.disk_tokens"},
      {head + node + "[scheduler]\nprefix_caching = false\n[kv]\nhost_tokens = 1024\n",
       "m.toml:12: kv: host, disk and store tiers hold named (prefix-cached) blocks"},
      {head + node + "[parallelism]\nreplicas = 2\n",
       "parallelism.replicas: 2 replicas need at least 2 nodes holding stages (each replica has "
       "nodes of its own); the manifest has 1"},
      {head + node + "[parallelism]\nreplicas = \"many\"\n",
       "m.toml:11: parallelism.replicas: expected \"auto\" or a number of replicas"},
      {head + node + "[parallelism]\nreplicas = 0\n",
       "m.toml:11: parallelism.replicas: must be in [1, "},
      {head + node + "[parallelism]\nreplicas = \"auto\"\n[kv]\nstore_tokens = 4096\n",
       "kv.store_tokens: a KV store serves one replica so far"},
      {head + node + "[router]\nmax_imbalance = -1\n",
       "m.toml:11: router.max_imbalance: must be in [0, "},
      {head + node + "[router]\nsticky = true\n", "m.toml:11: router.sticky: unknown key"},
      {head + node + "[router]\nmin_prefix_share = 1.5\n",
       "m.toml:11: router.min_prefix_share: must be in [0"},
      {head + node + "[kv]\nstore_tokens = 4\n",
       "m.toml:11: kv.store_tokens: holds no KV block of 16 tokens"},
      {head + node + "[kv]\nstore_node = \"a\"\n",
       "m.toml:11: kv.store_node: set without kv.store_tokens"},
      {head + node + "[kv]\nstore_tokens = 4096\nstore_node = \"zz\"\n",
       "kv.store_node: 'zz' is not the name of any node"},
      {head + node + "role = \"cache\"\n",
       "m.toml:10: nodes[0].role: 'cache': \"stages\" (the default), \"kv\""},
      {head + node + "role = \"kv\"\n[kv]\nstore_tokens = 4096\n",
       "nodes.a.role: the head runs the scheduler and takes stages"},
      {head + node +
           "[[nodes]]\nname = \"b\"\nhost = \"127.0.0.1\"\nport = 7401\ndevices = [{ type = "
           "\"cpu\" }]\nrole = \"kv\"\n",
       "nodes.b.role: \"kv\" without kv.store_tokens: the node would hold nothing"},
      {head + node +
           "[[nodes]]\nname = \"b\"\nhost = \"127.0.0.1\"\nport = 7401\ndevices = [{ type = "
           "\"cpu\" }]\nrole = \"kv\"\n[kv]\nstore_tokens = 4096\nstore_node = \"a\"\n",
       "nodes.b.role: \"kv\", but kv.store_node puts the store on 'a'"},
      {head + "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 70000\ndevices = [{ type = "
              "\"cpu\" }]\n",
       "m.toml:8: nodes[0].port: must be in [1, 65535], got 70000"},
      {head + "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = "
              "\"gpu\" }]\n",
       "m.toml:9: nodes[0].devices[0].type: expected cpu, cuda or npu, got 'gpu'"},
      {head + "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = "
              "\"cpu\", cores = \"7-2\" }]\n",
       "nodes[0].devices[0].cores: expected a core (\"3\") or a range (\"0-7\"), got '7-2'"},
      {head + "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = "
              "\"cpu\", memory = \"lots\" }]\n",
       "nodes[0].devices[0].memory: expected a size"},
      {head + "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = []\n",
       "m.toml:9: nodes[0].devices: a node needs at least one device"},
      {head + "[[nodes]]\nname = \"a\"\nhost = \"0.0.0.0\"\nport = 7400\ndevices = [{ type = "
              "\"cpu\" }]\n",
       "m.toml:7: nodes[0].host: binding every interface"},
      {head + node + node, "nodes[1].name: 'a' is already the name of the node at line 5"},
      {"[cluster]\nname = \"x\"\nhead = \"zz\"\ncerts = \"c\"\n" + node,
       "cluster.head: 'zz' is not the name of any node"},
      {"[cluster]\nname = \"x\"\nhead = \"a\"\n" + node, "m.toml:1: cluster.certs: missing"},
      {head, "nodes: the cluster has no nodes"},
      {head + node + "[model]\nquant = \"q5_k\"\n",
       "m.toml:11: model.quant: unknown weight format 'q5_k'"},
      {head + node + "[parallelism]\npipeline_stages = 4\n",
       "parallelism: 4 stages x 1 tensor-parallel ranks need 4 devices; the nodes have 1"},
      {head + node + "[parallelism]\npipeline_stages = \"many\"\n",
       "m.toml:11: parallelism.pipeline_stages: expected \"auto\""},
      {head + node + "[placement]\ngain_threshold = -1\n",
       "m.toml:11: placement.gain_threshold: must be in [0, 10], got -1"},
      {head + node + "[placement]\ncooldown_s = \"long\"\n",
       "m.toml:11: placement.cooldown_s: expected a number"},
      {head + node + "[placement]\nrebalance = 1\n",
       "m.toml:11: placement.rebalance: expected true or false"},
      {head + node + "[placement]\nmemory_pressure = 1.5\n",
       "m.toml:11: placement.memory_pressure: must be in [0.05, 1], got 1.5"},
      {head + node + "[placement]\nmeasure_s = 0.5\n",
       "m.toml:11: placement.measure_s: must be in [2, 3600], got 0.5"},
      {head + node + "[placement]\nplanner = \"greedy\"\n",
       "m.toml:11: placement.planner: unknown key"},
      {head + "[cluster]\n", "not valid TOML"},
      {head + node +
           "[[nodes]]\nname = \"b\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = "
           "\"cpu\" }]\n",
       "nodes[1].port: 127.0.0.1:7400 is already node 'a''s address"},
      {head + "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = "
              "\"cuda\", cores = \"1\" }]\n",
       "nodes[0].devices[0].cores: only a cpu device has cores"},
      {"[cluster]\nname = \"x\"\nhead = \"a\"\ncerts = \"c\"\nlaunch = \"ssh somewhere\"\n" + node,
       "m.toml:5: cluster.launch: must contain {host}"},
      {"[cluster]\nname = \"x\"\nhead = \"\"\ncerts = \"c\"\n" + node,
       "m.toml:3: cluster.head: must not be empty"},
      {"[cluster]\nname = \"x\"\nhead = \"client\"\ncerts = \"c\"\n[[nodes]]\nname = "
       "\"client\"\nhost = \"127.0.0.1\"\nport = 7400\n"
       "devices = [{ type = \"cpu\" }]\n",
       "m.toml:5: nodes[0].name: 'client' is reserved"},
  };
  for (const auto& c : cases) {
    auto m = parse_manifest(c.text, "m.toml");
    ASSERT_FALSE(m) << "accepted:\n" << c.text;
    EXPECT_NE(joined(m.error()).find(c.expect), std::string::npos)
        << "wanted: " << c.expect << "\ngot:\n"
        << joined(m.error());
  }
}

// [kv]: the tiers' sizes, and a relative disk folder resolved against the
// manifest's directory.
TEST(Manifest, ReplicasAndTheRouter) {
  auto one = parse_manifest(good, "lab.toml");
  ASSERT_TRUE(one) << joined(one.error());
  EXPECT_EQ(one->parallelism.replicas, 1);
  EXPECT_TRUE(one->router.prefix);
  EXPECT_EQ(one->router.max_imbalance, 4);
  EXPECT_DOUBLE_EQ(one->router.min_prefix_share, 0.5);
  // Two nodes, one stage each: two replicas fit; "auto" is 0.
  std::string text = good;
  text.replace(text.find("pipeline_stages = 2"), 19, "pipeline_stages = 1\nreplicas = 2");
  auto two = parse_manifest(
      text + "\n[router]\nprefix = false\nmax_imbalance = 9\nmin_prefix_share = 0.25\n",
      "lab.toml");
  ASSERT_TRUE(two) << joined(two.error());
  EXPECT_EQ(two->parallelism.replicas, 2);
  EXPECT_FALSE(two->router.prefix);
  EXPECT_EQ(two->router.max_imbalance, 9);
  EXPECT_DOUBLE_EQ(two->router.min_prefix_share, 0.25);
  text.replace(text.find("replicas = 2"), 12, "replicas = \"auto\"");
  auto each = parse_manifest(text, "lab.toml");
  ASSERT_TRUE(each) << joined(each.error());
  EXPECT_EQ(each->parallelism.replicas, 0);
  // Two replicas of two stages need four nodes.
  std::string four = good;
  four.replace(four.find("tensor_parallel = 1"), 19, "replicas = 2");
  auto short_of = parse_manifest(four, "lab.toml");
  ASSERT_FALSE(short_of);
  EXPECT_NE(joined(short_of.error()).find("2 replicas of 2 stages need at least 4 nodes"),
            std::string::npos)
      << joined(short_of.error());
}

TEST(Manifest, EncoderServices) {
  auto plain = parse_manifest(good, "lab.toml");
  ASSERT_TRUE(plain) << joined(plain.error());
  EXPECT_EQ(plain->encoders.vision.min, 1);
  EXPECT_EQ(plain->encoders.vision.max, 1);
  EXPECT_DOUBLE_EQ(plain->encoders.vision.up_queue, 4);
  EXPECT_DOUBLE_EQ(plain->encoders.vision.up_latency_ms, 1000);
  EXPECT_DOUBLE_EQ(plain->encoders.vision.up_after_s, 2);
  EXPECT_DOUBLE_EQ(plain->encoders.vision.down_after_s, 60);
  auto set = parse_manifest(std::string(good) +
                                "\n[encoders.vision]\nmin = 1\nmax = 2\nup_queue = 2.5\n"
                                "up_latency_ms = 300\nup_after_s = 1\ndown_after_s = 5\n",
                            "lab.toml");
  ASSERT_TRUE(set) << joined(set.error());
  EXPECT_EQ(set->encoders.vision.max, 2);
  EXPECT_DOUBLE_EQ(set->encoders.vision.up_queue, 2.5);
  EXPECT_DOUBLE_EQ(set->encoders.vision.up_latency_ms, 300);
  EXPECT_DOUBLE_EQ(set->encoders.vision.up_after_s, 1);
  EXPECT_DOUBLE_EQ(set->encoders.vision.down_after_s, 5);
  // min alone: max follows it.
  auto fixed = parse_manifest(std::string(good) + "\n[encoders.vision]\nmin = 2\n", "lab.toml");
  ASSERT_TRUE(fixed) << joined(fixed.error());
  EXPECT_EQ(fixed->encoders.vision.max, 2);
  auto refused = [](const std::string& extra, const std::string& says) {
    auto m = parse_manifest(std::string(good) + extra, "lab.toml");
    ASSERT_FALSE(m) << extra;
    EXPECT_NE(joined(m.error()).find(says), std::string::npos) << joined(m.error());
  };
  refused("\n[encoders.vision]\nmin = 2\nmax = 1\n", "encoders.vision.max: 1 is below min (2)");
  refused("\n[encoders.vision]\nmax = 3\n", "3 replicas of the vision encoder need as many nodes");
  refused("\n[encoders.vision]\nmin = 0\n", "encoders.vision.min: must be in [1, 1024]");
  refused("\n[encoders.vision]\nqueue = 3\n", "encoders.vision.queue: unknown key");
  refused("\n[encoders.audio]\nmax = 1\n", "encoders.audio: unknown key");
  refused("\n[encoders.vision]\nup_queue = 0\n", "encoders.vision.up_queue: must be in");
}

TEST(Manifest, MediaLimits) {
  auto plain = parse_manifest(good, "lab.toml");
  ASSERT_TRUE(plain) << joined(plain.error());
  EXPECT_EQ(plain->media.max_images, 16);
  EXPECT_EQ(plain->media.max_videos, 4);
  EXPECT_EQ(plain->media.video_frames, 8);
  EXPECT_EQ(plain->media.max_video_frames, 64);
  auto set = parse_manifest(std::string(good) +
                                "\n[media]\nmax_images = 2\nmax_audios = 0\nmax_videos = 1\n"
                                "video_frames = 4\nmax_video_frames = 16\n"
                                "max_video_seconds = 30.5\nmax_video_side = 1280\n",
                            "lab.toml");
  ASSERT_TRUE(set) << joined(set.error());
  EXPECT_EQ(set->media.max_images, 2);
  EXPECT_EQ(set->media.max_audios, 0);
  EXPECT_EQ(set->media.max_videos, 1);
  EXPECT_EQ(set->media.video_frames, 4);
  EXPECT_EQ(set->media.max_video_frames, 16);
  EXPECT_DOUBLE_EQ(set->media.max_video_seconds, 30.5);
  EXPECT_EQ(set->media.max_video_side, 1280);
  auto refused = [](const std::string& extra, const std::string& says) {
    auto m = parse_manifest(std::string(good) + extra, "lab.toml");
    ASSERT_FALSE(m) << extra;
    EXPECT_NE(joined(m.error()).find(says), std::string::npos) << joined(m.error());
  };
  refused("\n[media]\nvideo_frames = 32\nmax_video_frames = 16\n",
          "media.video_frames: 32 is above max_video_frames (16)");
  refused("\n[media]\nmax_video_frames = 0\n", "media.max_video_frames: must be in [1, 1024]");
  refused("\n[media]\nmax_video_seconds = -1\n", "media.max_video_seconds: must be in");
  refused("\n[media]\nlimit_mm_per_prompt = 3\n", "media.limit_mm_per_prompt: unknown key");
}

// A head that holds no stage (a dedicated head: schedulers, router,
// gateway) leaves every stage to the other nodes.
TEST(Manifest, AHeadOfRoleHeadHoldsNoStage) {
  std::string text = good;
  text.replace(text.find("pipeline_stages = 2"), 19, "pipeline_stages = 1");
  const auto at = text.find("name = \"a\"");
  ASSERT_NE(at, std::string::npos);
  text.insert(text.find('\n', at) + 1, "role = \"head\"\n");
  auto m = parse_manifest(text, "lab.toml");
  ASSERT_TRUE(m) << joined(m.error());
  EXPECT_FALSE(m->head_node().holds_stages());
  EXPECT_EQ(m->head_node().role, "head");
  // Two replicas would need two nodes with stages: only b is left.
  auto two = text;
  two.replace(two.find("pipeline_stages = 1"), 19, "pipeline_stages = 1\nreplicas = 2");
  auto refused = parse_manifest(two, "lab.toml");
  ASSERT_FALSE(refused);
  EXPECT_NE(joined(refused.error()).find("2 replicas need at least 2 nodes holding stages"),
            std::string::npos)
      << joined(refused.error());
  // Only the head may be of role "head".
  std::string other = good;
  const auto n1 = other.find("name = \"b\"");
  ASSERT_NE(n1, std::string::npos);
  other.insert(other.find('\n', n1) + 1, "role = \"head\"\n");
  auto wrong = parse_manifest(other, "lab.toml");
  ASSERT_FALSE(wrong);
  EXPECT_NE(joined(wrong.error()).find("\"head\", but the cluster's head is 'a'"),
            std::string::npos)
      << joined(wrong.error());
}

TEST(Manifest, AStandbyHeadIsAnotherNode) {
  auto with = [](const std::string& line) {
    std::string text = good;
    text.insert(text.find("certs = \"certs\"") + 16, "\n" + line);
    return parse_manifest(text, "lab.toml");
  };
  auto ok = with("standby = \"b\"");
  ASSERT_TRUE(ok) << joined(ok.error());
  EXPECT_EQ(ok->standby, "b");
  auto none = parse_manifest(good, "lab.toml");
  ASSERT_TRUE(none);
  EXPECT_TRUE(none->standby.empty());
  for (const auto& [line, says] : std::vector<std::pair<std::string, std::string>>{
           {"standby = \"a\"", "'a' is the head itself"},
           {"standby = \"zz\"", "'zz' is not the name of any node"},
           {"standby = \"\"", "cluster.standby: must not be empty"},
           {"standby = 3", "cluster.standby"}}) {
    auto bad = with(line);
    ASSERT_FALSE(bad) << line;
    EXPECT_NE(joined(bad.error()).find(says), std::string::npos) << joined(bad.error());
  }
  // The standby, like the head, may be a dedicated node of role "head".
  std::string text = good;
  text.insert(text.find("certs = \"certs\"") + 16, "\nstandby = \"b\"");
  text.replace(text.find("pipeline_stages = 2"), 19, "pipeline_stages = 1");
  text.insert(text.find('\n', text.find("name = \"b\"")) + 1, "role = \"head\"\n");
  auto dedicated = parse_manifest(text, "lab.toml");
  ASSERT_TRUE(dedicated) << joined(dedicated.error());
  EXPECT_FALSE(dedicated->node("b")->holds_stages());
}

TEST(Manifest, KvTiers) {
  const std::string text = std::string(good) +
                           "\n[kv]\nhost_tokens = 65536\ndisk_tokens = 262144\ndisk_dir = "
                           "\"kv\"\n";
  auto m = parse_manifest(text, "/etc/troupe/lab.toml");
  ASSERT_TRUE(m) << joined(m.error());
  EXPECT_EQ(m->kv.host_tokens, 65536);
  EXPECT_EQ(m->kv.disk_tokens, 262144);
  EXPECT_EQ(m->kv.disk_dir, "/etc/troupe/kv");
  EXPECT_EQ(m->kv.store_tokens, 0);
  EXPECT_EQ(m->kv.store_node, "") << "no store, no node for it";
  auto none = parse_manifest(good, "/etc/troupe/lab.toml");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->kv.host_tokens, 0);
  EXPECT_EQ(none->kv.disk_dir, "");
  // A store: on the head unless a node of role "kv" is there.
  auto store = parse_manifest(std::string(good) + "\n[kv]\nstore_tokens = 65536\n", "lab.toml");
  ASSERT_TRUE(store) << joined(store.error());
  EXPECT_EQ(store->kv.store_tokens, 65536);
  EXPECT_EQ(store->kv.store_node, store->head);
  for (const auto& n : store->nodes) EXPECT_TRUE(n.holds_stages()) << n.name;
  // A node of role "kv" holds it (and no stage).
  auto kv_node = parse_manifest(std::string(good) +
                                    "\n[[nodes]]\nname = \"c\"\nhost = \"10.0.0.3\"\nport = "
                                    "7400\ndevices = [{ type = \"cpu\", memory = \"64GiB\" }]\n"
                                    "role = \"kv\"\n[kv]\nstore_tokens = 1048576\n",
                                "lab.toml");
  ASSERT_TRUE(kv_node) << joined(kv_node.error());
  EXPECT_EQ(kv_node->kv.store_node, "c");
  ASSERT_NE(kv_node->node("c"), nullptr);
  EXPECT_FALSE(kv_node->node("c")->holds_stages());
  EXPECT_TRUE(kv_node->node("a")->holds_stages());
}

// Tensor parallelism: each stage's ranks are nodes; the manifest must have
// nodes for every rank of every stage of every replica, and what does not
// combine with it yet is refused by name.
TEST(Manifest, TensorParallelStagesNeedANodePerRank) {
  auto with = [](const std::string& parallelism, const std::string& more = "") {
    std::string text = good;
    const auto at = text.find("pipeline_stages = 2\ntensor_parallel = 1");
    text.replace(at, std::string("pipeline_stages = 2\ntensor_parallel = 1").size(), parallelism);
    return parse_manifest(text + more, "lab.toml");
  };
  auto one = with("pipeline_stages = 1\ntensor_parallel = 2");
  ASSERT_TRUE(one) << joined(one.error());
  EXPECT_EQ(one->parallelism.tensor_parallel, 2);
  auto expect_error = [&](const std::string& parallelism, const std::string& more,
                          const std::string& why) {
    auto m = with(parallelism, more);
    ASSERT_FALSE(m) << parallelism << more;
    EXPECT_NE(joined(m.error()).find(why), std::string::npos) << joined(m.error());
  };
  expect_error("pipeline_stages = 2\ntensor_parallel = 2", "",
               "2 stages of 2 tensor-parallel ranks need 4 nodes holding stages");
  expect_error("pipeline_stages = 1\ntensor_parallel = 2\nreplicas = 2", "",
               "2 replicas of 2 tensor-parallel ranks need at least 4 nodes");
  expect_error("pipeline_stages = \"auto\"\ntensor_parallel = 2", "",
               "parallelism.pipeline_stages: \"auto\" with tensor_parallel = 2");
  expect_error("pipeline_stages = 1\ntensor_parallel = 2\nreplicas = \"auto\"", "",
               "parallelism.replicas: \"auto\" with tensor_parallel = 2");
  expect_error("pipeline_stages = 1\ntensor_parallel = \"auto\"", "",
               "parallelism.tensor_parallel: \"auto\" is not built");
  expect_error("pipeline_stages = 1\ntensor_parallel = 2", "\n[kv]\nhost_tokens = 65536\n",
               "tiers with tensor_parallel = 2 are not supported yet");
}

TEST(Manifest, SeveralMistakesAreAllReported) {
  const std::string text =
      "[cluster]\nname = \"x y\"\nhead = \"a\"\ncerts = \"c\"\n"
      "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 0\ndevices = [{ type = \"npu\", index "
      "= -1 }]\nextra = true\n";
  auto m = parse_manifest(text, "m.toml");
  ASSERT_FALSE(m);
  const auto all = joined(m.error());
  EXPECT_NE(all.find("m.toml:2: cluster.name"), std::string::npos) << all;
  EXPECT_NE(all.find("m.toml:8: nodes[0].port"), std::string::npos) << all;
  EXPECT_NE(all.find("nodes[0].devices[0].index: must be in [0, 255], got -1"), std::string::npos)
      << all;
  EXPECT_NE(all.find("m.toml:10: nodes[0].extra: unknown key"), std::string::npos) << all;
  EXPECT_GE(m.error().messages.size(), 4u);
}

TEST(Manifest, UnreadableAndOversizedFilesFailCleanly) {
  auto m = load_manifest("/nonexistent/troupe.toml");
  ASSERT_FALSE(m);
  EXPECT_NE(joined(m.error()).find("cannot read the manifest"), std::string::npos);
  const std::string big = troupe::test::temp_path("big.toml");
  {
    std::ofstream f(big);
    f << std::string(2u << 20, '#');
  }
  m = load_manifest(big);
  std::remove(big.c_str());
  ASSERT_FALSE(m);
  EXPECT_NE(joined(m.error()).find("larger than 1 MiB"), std::string::npos);
  // A symlink to a device that never ends (it used to hang `up` and grow
  // `status` to 4 GB): refused without reading.
  const std::string zero = troupe::test::temp_path("zero.toml");
  std::remove(zero.c_str());
  ASSERT_EQ(::symlink("/dev/zero", zero.c_str()), 0);
  m = load_manifest(zero);
  std::remove(zero.c_str());
  ASSERT_FALSE(m);
  EXPECT_NE(joined(m.error()).find("not a regular file"), std::string::npos) << joined(m.error());
  m = load_manifest("/dev/zero");
  ASSERT_FALSE(m);
  EXPECT_NE(joined(m.error()).find("not a regular file"), std::string::npos);
  // Binary garbage is a TOML error, not a crash.
  std::string junk;
  for (int i = 0; i < 4096; ++i) junk.push_back(static_cast<char>((i * 131 + 7) % 256));
  m = parse_manifest(junk, "junk.toml");
  ASSERT_FALSE(m);
  EXPECT_NE(joined(m.error()).find("junk.toml"), std::string::npos);
}

TEST(Manifest, SizesParse) {
  EXPECT_EQ(parse_bytes("16GiB"), 16ull << 30);
  EXPECT_EQ(parse_bytes("512 MiB"), 512ull << 20);
  EXPECT_EQ(parse_bytes("2G"), 2ull << 30);
  EXPECT_EQ(parse_bytes("3gb"), 3000000000ull);
  EXPECT_EQ(parse_bytes("1000"), 1000ull);
  EXPECT_FALSE(parse_bytes(""));
  EXPECT_FALSE(parse_bytes("0"));
  EXPECT_FALSE(parse_bytes("GiB"));
  EXPECT_FALSE(parse_bytes("12 parsecs"));
  EXPECT_FALSE(parse_bytes("99999999999999999999"));
  EXPECT_FALSE(parse_bytes("99999999999TiB"));
}

}  // namespace
}  // namespace troupe::cluster
