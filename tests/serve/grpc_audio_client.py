#!/usr/bin/env python3
"""A real gRPC client (Debian's python3-grpcio and python3-protobuf) that
streams an audio clip into `troupe serve --grpc-port`'s GenerateFromChunks
(start.audio_stream, then `audio` pieces of 16 kHz 16-bit PCM) and checks
the answer against the text the direct loop gave for the whole clip, and
that misuse is refused by name. Run by
GatewayHears.GrpcStreamsAudioIntoTheRequest.

  grpc_audio_client.py PORT API_KEY DIR_OF_troupe_generate_pb2 WAV EXPECTED_TEXT
"""
import sys
import wave

import grpc

port, key, gen, clip, expected = sys.argv[1:6]
sys.path.insert(0, gen)
import troupe_generate_pb2 as pb  # noqa: E402

channel = grpc.insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(channel).result(timeout=20)
auth = [("authorization", f"Bearer {key}")]
chunks = channel.stream_stream("/troupe.v1.Generation/GenerateFromChunks",
                               request_serializer=pb.InputChunk.SerializeToString,
                               response_deserializer=pb.GenerateChunk.FromString)
generate = channel.unary_unary("/troupe.v1.Generation/Generate",
                               request_serializer=pb.GenerateRequest.SerializeToString,
                               response_deserializer=pb.GenerateResponse.FromString)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


with wave.open(clip) as w:
    assert w.getframerate() == 16000 and w.getsampwidth() == 2 and w.getnchannels() == 1
    pcm = w.readframes(w.getnframes())

ask = pb.GenerateRequest(messages=[pb.Message(role="user", content="What is said?")],
                         max_tokens=12, temperature=0, audio_stream=True)


def pieces(piece_bytes=16000):  # 0.5 s each
    yield pb.InputChunk(start=ask)
    for at in range(0, len(pcm), piece_bytes):
        yield pb.InputChunk(audio=pcm[at:at + piece_bytes], last=at + piece_bytes >= len(pcm))


out = list(chunks(pieces(), metadata=auth, timeout=60))
text = "".join(c.text for c in out).lstrip(" ")
check(text == expected, f"streamed audio: the whole clip's answer ({text!r} vs {expected!r})")
check(out[-1].finish_reason in ("stop", "length") and out[-1].prompt_tokens > 20,
      f"streamed audio: the last message's usage ({out[-1].prompt_tokens} prompt tokens)")


def refused(call, what, code=grpc.StatusCode.INVALID_ARGUMENT):
    try:
        call()
        check(False, f"refused: {what}")
    except grpc.RpcError as e:
        check(e.code() == code and what in e.details(), f"refused with {code.name}: {e.details()}")


refused(lambda: generate(ask, metadata=auth, timeout=30), "audio_stream is for GenerateFromChunks")
refused(lambda: list(chunks(iter([pb.InputChunk(start=pb.GenerateRequest(
    prompt="x", audio_stream=True))]), metadata=auth, timeout=30)), "needs messages")
refused(lambda: list(chunks(iter([pb.InputChunk(start=pb.GenerateRequest(prompt="x")),
                                  pb.InputChunk(audio=b"\0\0", last=True)]),
                            metadata=auth, timeout=30)), "need start.audio_stream")
refused(lambda: list(chunks(iter([pb.InputChunk(start=ask), pb.InputChunk(audio=b"\0\0\0", last=True)]),
                            metadata=auth, timeout=30)), "odd byte count")
refused(lambda: list(chunks(iter([pb.InputChunk(start=ask), pb.InputChunk(text="hi", last=True)]),
                            metadata=auth, timeout=30)), "carry `audio`")

print("grpc audio client: " + ("all checks passed" if not failures else f"{len(failures)} failed"))
sys.exit(1 if failures else 0)
