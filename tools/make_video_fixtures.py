#!/usr/bin/env python3
"""Video fixtures for troupe's video decoding tests (tests/models/
video_test.cpp), under tests/fixtures/video/.

Not run by CI; the outputs are committed. Run from the repository root:

    python3 -m pip install --target /tmp/pydeps-av av numpy
    PYTHONPATH=/tmp/pydeps-av python3 tools/make_video_fixtures.py

The frames are drawn here (numpy), then encoded with PyAV's own FFmpeg
build (not Debian's, which troupe decodes with). The test checks what
troupe decodes against the drawing, not against a decoder: frame i of
every clip is a flat gray-blue background with a 16 x 16 square whose
color and position follow i (see `frame`), so any frame sampled can be
told apart by its square.

- square.mp4    H.264 (libx264, qp 0, yuv444p), MP4, 64 x 48, 30 frames at 10 fps
- square.webm   VP9 (lossless), WebM, the same frames
- square.avi    MJPEG (q 2, yuvj444p), AVI, the same frames
- square_aac.mp4  H.264 + an AAC audio track (a 440 Hz tone), 20 frames
- playlist.ffconcat  an ffconcat list naming /etc/hostname (must be refused)
- playlist.m3u8      an HLS playlist naming a local file (must be refused)
- frames.json   for each clip: frames, fps, size, and the (i, x, y, rgb) of
                each frame's square (the drawing's parameters)
"""

import json
import os

import av
import numpy as np

OUT = "tests/fixtures/video"
W, H = 64, 48
BG = (40, 60, 160)


def square(i):
    x = (i * 3) % (W - 16)
    y = (i * 2) % (H - 16)
    rgb = (200 + (i * 7) % 56, (i * 37) % 256, 30 + (i * 11) % 100)
    return x, y, rgb


def frame(i):
    img = np.empty((H, W, 3), np.uint8)
    img[:, :] = BG
    x, y, rgb = square(i)
    img[y:y + 16, x:x + 16] = rgb
    return img


def write(path, codec, n, fps, pix_fmt, options, audio=False):
    with av.open(path, "w") as c:
        s = c.add_stream(codec, rate=fps, options=options)
        s.width, s.height, s.pix_fmt = W, H, pix_fmt
        a = None
        if audio:
            a = c.add_stream("aac", rate=16000)
            a.layout = "mono"
        for i in range(n):
            f = av.VideoFrame.from_ndarray(frame(i), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
        if a is not None:
            t = np.arange(int(16000 * n / fps)) / 16000
            tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
            for k in range(0, tone.size, 1024):
                af = av.AudioFrame.from_ndarray(tone[None, k:k + 1024], format="flt",
                                                layout="mono")
                af.sample_rate = 16000
                af.pts = k
                for p in a.encode(af):
                    c.mux(p)
            for p in a.encode():
                c.mux(p)


def main():
    os.makedirs(OUT, exist_ok=True)
    clips = {
        "square.mp4": ("libx264", 30, 10, "yuv444p", {"qp": "0", "preset": "medium"}, False),
        "square.webm": ("libvpx-vp9", 30, 10, "yuv444p", {"lossless": "1"}, False),
        "square.avi": ("mjpeg", 30, 10, "yuvj444p", {"q:v": "2"}, False),
        "square_aac.mp4": ("libx264", 20, 10, "yuv444p", {"qp": "0"}, True),
    }
    meta = {"width": W, "height": H, "background": BG, "square": 16, "clips": {}}
    for name, (codec, n, fps, pix, opts, audio) in clips.items():
        write(f"{OUT}/{name}", codec, n, fps, pix, opts, audio)
        meta["clips"][name] = {"frames": n, "fps": fps}
    meta["squares"] = [dict(zip(("x", "y", "rgb"), square(i))) for i in range(30)]
    with open(f"{OUT}/playlist.ffconcat", "w") as f:
        f.write("ffconcat version 1.0\nfile '/etc/hostname'\n")
    with open(f"{OUT}/playlist.m3u8", "w") as f:
        f.write("#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\nfile:///etc/hostname\n"
                "#EXT-X-ENDLIST\n")
    with open(f"{OUT}/frames.json", "w") as f:
        json.dump(meta, f, indent=1)
    # What PyAV itself decodes, for the record (not used by the test).
    for name in clips:
        with av.open(f"{OUT}/{name}") as c:
            v = c.streams.video[0]
            got = [fr.to_ndarray(format="rgb24") for fr in c.decode(v)]
            err = max(int(np.abs(g.astype(int) - frame(i).astype(int)).max())
                      for i, g in enumerate(got))
            print(f"{name}: {len(got)} frames, {v.codec_context.name}, PyAV max |diff| {err}")
    with open(f"{OUT}/README.md", "w") as f:
        f.write("Made by tools/make_video_fixtures.py (see its docstring); do not edit.\n")


if __name__ == "__main__":
    main()
