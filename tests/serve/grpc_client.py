#!/usr/bin/env python3
"""A real gRPC client (Debian's python3-grpcio and python3-protobuf) of
`troupe serve --grpc-port`: health, auth, unary, server streaming,
chunked input, errors and structured output. Run by
Gateway.GrpcServesGenerationWithHealthAuthAndChunkedInput.

  grpc_client.py PORT API_KEY DIR_OF_troupe_generate_pb2
"""
import sys

import grpc

port, key, gen = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, gen)
import troupe_generate_pb2 as pb  # noqa: E402

channel = grpc.insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(channel).result(timeout=20)
auth = [("authorization", f"Bearer {key}")]
ident = lambda b: b  # noqa: E731


def method(name, kind, req, res):
    path = f"/troupe.v1.Generation/{name}"
    return getattr(channel, kind)(path, request_serializer=req.SerializeToString,
                                  response_deserializer=res.FromString)


generate = method("Generate", "unary_unary", pb.GenerateRequest, pb.GenerateResponse)
stream = method("GenerateStream", "unary_stream", pb.GenerateRequest, pb.GenerateChunk)
chunks = method("GenerateFromChunks", "stream_stream", pb.InputChunk, pb.GenerateChunk)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


# grpc.health.v1: HealthCheckRequest{service} -> HealthCheckResponse{status}
# (SERVING = 1), written by hand: the module is not in python3-grpcio.
health = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=ident,
                             response_deserializer=ident)
check(health(b"") == b"\x08\x01", "health: the server is SERVING")
name = b"troupe.v1.Generation"
check(health(b"\x0a" + bytes([len(name)]) + name) == b"\x08\x01", "health: the service is SERVING")

try:
    generate(pb.GenerateRequest(prompt="A red"))
    check(False, "a call without the key is refused")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.UNAUTHENTICATED, "a call without the key is UNAUTHENTICATED")

req = pb.GenerateRequest(prompt="A red circle and a blue", max_tokens=10, temperature=0,
                         top_logprobs=2, ignore_eos=True)
one = generate(req, metadata=auth, timeout=60)
check(one.completion_tokens == 10 and len(one.tokens) == 10, f"unary: 10 tokens ({one.completion_tokens})")
check(len(one.logprobs) == 10 and all(len(l.top_ids) == 2 for l in one.logprobs),
      "unary: logprobs with 2 alternatives each")
parts = list(stream(req, metadata=auth, timeout=60))
text = "".join(c.text for c in parts)
check(text == one.text, f"stream: the same text ({text!r} vs {one.text!r})")
check(parts[-1].finish_reason == "length" and parts[-1].completion_tokens == 10,
      "stream: the last message has the finish reason and usage")


def pieces():
    yield pb.InputChunk(start=pb.GenerateRequest(prompt="A red", max_tokens=10, temperature=0,
                                                 ignore_eos=True))
    yield pb.InputChunk(text=" circle and")
    yield pb.InputChunk(text=" a blue", last=True)


got = "".join(c.text for c in chunks(pieces(), metadata=auth, timeout=60))
check(got == one.text, f"chunked input: the same as the whole prompt ({got!r})")

chat = pb.GenerateRequest(messages=[pb.Message(role="user", content="Name a shape.")],
                          max_tokens=8, temperature=1, seed=3, choice=["circle", "square"])
picked = generate(chat, metadata=auth, timeout=60).text
check(picked in ("circle", "square"), f"structured output: a choice ({picked!r})")

for bad, code, what in [
        (pb.GenerateRequest(prompt="x", temperature=9), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (pb.GenerateRequest(prompt="x", model="gpt-4o"), grpc.StatusCode.NOT_FOUND, "gpt-4o"),
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (pb.GenerateRequest(prompt="x", json_schema='{"type": "number", "minimum": 1}'),
         grpc.StatusCode.INVALID_ARGUMENT, "minimum")]:
    try:
        generate(bad, metadata=auth, timeout=30)
        check(False, f"refused: {what}")
    except grpc.RpcError as e:
        check(e.code() == code and what in e.details(), f"refused with {code.name}: {e.details()}")

print("grpc client: " + ("all checks passed" if not failures else f"{len(failures)} failed"))
sys.exit(1 if failures else 0)
