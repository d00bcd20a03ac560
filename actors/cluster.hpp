#pragma once

// The cluster's actors: every node's agent (it holds the stages the head
// places on its node) and the head (membership, placement, the scheduler,
// the vision encoder and the door for clients). The plain logic they act
// on (the membership state machine, the placement rule) is in cluster/.
//
// The parts, each in its own header:
// - node_agent.hpp: every node's agent (`node_config`, `spawn_node_agent`);
// - head.hpp: the head (`head_config`, `spawn_head`); how it places the
//   stages and replaces a lost node is described there;
// - cluster_client.hpp: a client of the head's door (`connect_client`,
//   `query_status`, `migrate_shard`); jobs go through actors::client
//   (client.hpp), the one client for a local scheduler and a door alike.

#include "actors/cluster_client.hpp"
#include "actors/head.hpp"
#include "actors/node_agent.hpp"
