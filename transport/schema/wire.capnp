@0xba326e541319325d;
# Wire headers of troupe's data plane. Tensors themselves never travel in
# these messages: a header describes what follows as raw chunks (tagged
# messages) or what a peer may read or write with RMA. Every field is
# validated before use (transport/wire.hpp).

$import "/capnp/c++.capnp".namespace("troupe::transport::wire");

# What a transfer carries.
enum Payload {
  activations @0;   # a stage's output for the next stage
  weights @1;       # a shard's weights (migration, loading from a peer)
  kvBlocks @2;      # paged KV blocks (migration, swap)
  partialSum @3;    # one shard's part of an all-reduce
}

# Describes one tensor moved as `chunkCount` tagged messages of
# `chunkBytes` (the last one may be shorter).
struct TensorHeader {
  transferId @0 :UInt64;
  payload @1 :Payload;
  dtype @2 :UInt8;            # kernels::dtype
  shape @3 :List(Int64);
  totalBytes @4 :UInt64;
  chunkBytes @5 :UInt64;
  chunkCount @6 :UInt32;
  device @7 :Text;            # where the sender holds it (for logs and checks)
}

# A chunk's own header, for engines that deliver chunks without a tag
# (active messages, streams); tagged engines put the index in the tag.
struct ChunkHeader {
  transferId @0 :UInt64;
  index @1 :UInt32;
  count @2 :UInt32;
  offset @3 :UInt64;
  bytes @4 :UInt64;
}

# Paged KV blocks of one shard's layers, exposed for RMA (export/import
# between KV stores): which blocks, how each is laid out, and the region
# key that reaches them for this one transfer.
struct KvBlockDescriptor {
  transferId @0 :UInt64;
  layerBegin @1 :UInt32;
  layerEnd @2 :UInt32;
  blockTokens @3 :UInt32;      # tokens per block
  bytesPerBlock @4 :UInt64;    # all of the range's layers, K and V
  dtype @5 :UInt8;
  blockIds @6 :List(UInt32);   # the sender's block ids, in sequence order
  regionKey @7 :Data;          # engine-specific key, scoped to this transfer
  regionBytes @8 :UInt64;
}
