#!/usr/bin/env python3
"""Audio fixtures for troupe's decoding and log-mel tests (tests/models/
audio_test.cpp), under tests/fixtures/audio/.

Not run by CI; the outputs are committed. Run from the repository root:

    # once, kept OUT of the repository (PyPI; torch is only needed for the
    # torch path's cross-check, the reference is the NumPy path)
    python3 -m pip install --target /tmp/pydeps-audio transformers==4.57.1 numpy soundfile
    python3 -m pip install --target /tmp/pydeps-torch torch==2.5.1
    PYTHONPATH=/tmp/pydeps-audio:/tmp/pydeps-torch python3 tools/make_audio_fixtures.py

Needs Debian's sox (FLAC encoding with libFLAC). The signals are made
here, deterministically, and written without libsndfile where that is
possible (Python's `wave` for PCM, a hand-written header for float WAV),
so the C++ decoder is checked against samples it did not produce:

- speech16k.wav     3.3 s, mono, PCM 16-bit, 16 kHz: a chirp, two tones
                    under an envelope, seeded noise;
- speech16k.flac    the same samples, FLAC (sox);
- speech16k.mp3     the same signal, MP3 at 64 kbit/s (soundfile's lame);
- stereo44k_24.wav  1 s, stereo, PCM 24-bit, 44.1 kHz: 1 kHz at 0.5 (left)
                    and 0.3 (right), so the mono mix is 0.4 sin(2 pi 1000 t);
- float16k.wav      0.5 s, mono, IEEE float 32-bit, 16 kHz;
- preprocessor_config.json  a 128-bin extractor with 4 s windows;
- expected.safetensors:
    speech16k        [52800] f32   the samples (int16 / 32768)
    stereo44k_mono   [44100] f32   (left + right) / 2 of the 24-bit ints / 2^23
    float16k         [8000]  f32   the float samples
    mel80_chunk5     [80, 500]  f32  WhisperFeatureExtractor(feature_size=80, chunk_length=5)
    mel128_chunk4    [128, 400] f32  ... (feature_size=128, chunk_length=4)
    mel80_chunk2     [80, 200]  f32  ... (chunk_length=2: the clip is cut)
    mel80_default    [80, 400]  f32  the first 400 of the default extractor's 3000 frames
    filters80        [201, 80]  f32  the default extractor's mel_filters (float64, rounded)
    filters128       [201, 128] f32

Every feature reference is transformers' NumPy path
(_np_extract_fbank_features, float64 FFTs); the script prints how far the
torch path (float32) lies from it.
"""

import json
import os
import struct
import subprocess
import wave

import numpy as np
from safetensors.numpy import save_file
import soundfile
from transformers import WhisperFeatureExtractor

OUT = "tests/fixtures/audio"


def speech_like(sr, seconds, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(int(sr * seconds)) / sr
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 2.5 * t) ** 2
    x = 0.25 * np.sin(2 * np.pi * (180 * t + 260 * t**2))
    x += 0.2 * env * np.sin(2 * np.pi * 440 * t) + 0.1 * env * np.sin(2 * np.pi * 1330 * t)
    x += 0.03 * rng.standard_normal(t.size)
    return np.clip(x, -1, 1)


def write_pcm(path, ints, sr, width, channels):
    with wave.open(path, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(sr)
        if width == 2:
            data = ints.astype("<i2").tobytes()
        elif width == 3:
            b = ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3]
            data = b.tobytes()
        else:
            raise ValueError(width)
        w.writeframes(data)


def write_float_wav(path, x, sr):
    data = x.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, sr, sr * 4, 4, 32)  # WAVE_FORMAT_IEEE_FLOAT
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"fact" + struct.pack("<II", 4, x.size)
    body += b"data" + struct.pack("<I", len(data)) + data
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(body)) + body)


def np_features(fe, x):
    """transformers' __call__ (padding, cutting) with its NumPy path."""
    np_path = WhisperFeatureExtractor(**fe.to_dict())
    np_path._torch_extract_fbank_features = np_path._np_extract_fbank_features
    out = np_path(x, sampling_rate=fe.sampling_rate, return_tensors="np")["input_features"][0]
    return out.astype(np.float32)


def main():
    os.makedirs(OUT, exist_ok=True)
    sr = 16000
    x = speech_like(sr, 3.3, 1234)
    ints16 = np.round(x * 32767).astype(np.int16)
    write_pcm(f"{OUT}/speech16k.wav", ints16, sr, 2, 1)
    speech = (ints16.astype(np.float64) / 32768).astype(np.float32)
    subprocess.run(["sox", f"{OUT}/speech16k.wav", f"{OUT}/speech16k.flac"], check=True)
    soundfile.write(f"{OUT}/speech16k.mp3", x, sr, format="MP3", subtype="MPEG_LAYER_III")

    sr44 = 44100
    t = np.arange(sr44) / sr44
    tone = np.sin(2 * np.pi * 1000 * t)
    left = np.round(0.5 * tone * (2**23 - 1)).astype(np.int32)
    right = np.round(0.3 * tone * (2**23 - 1)).astype(np.int32)
    inter = np.stack([left, right], axis=1).reshape(-1)
    write_pcm(f"{OUT}/stereo44k_24.wav", inter, sr44, 3, 2)
    stereo_mono = ((left.astype(np.float64) + right) / 2 / 2**23).astype(np.float32)

    fl = speech_like(sr, 0.5, 99).astype(np.float32) * 0.9
    write_float_wav(f"{OUT}/float16k.wav", fl, sr)

    tensors = {"speech16k": speech, "stereo44k_mono": stereo_mono, "float16k": fl}
    fe80_5 = WhisperFeatureExtractor(feature_size=80, chunk_length=5)
    fe128_4 = WhisperFeatureExtractor(feature_size=128, chunk_length=4)
    fe80_2 = WhisperFeatureExtractor(feature_size=80, chunk_length=2)
    fe80 = WhisperFeatureExtractor(feature_size=80)
    fe128 = WhisperFeatureExtractor(feature_size=128)
    tensors["mel80_chunk5"] = np_features(fe80_5, speech)
    tensors["mel128_chunk4"] = np_features(fe128_4, speech)
    tensors["mel80_chunk2"] = np_features(fe80_2, speech)
    tensors["mel80_default"] = np.ascontiguousarray(np_features(fe80, speech)[:, :400])
    tensors["filters80"] = np.ascontiguousarray(fe80.mel_filters.astype(np.float32))
    tensors["filters128"] = np.ascontiguousarray(fe128.mel_filters.astype(np.float32))
    for k, v in tensors.items():
        print(k, v.shape, v.dtype)
    save_file(tensors, f"{OUT}/expected.safetensors")
    fe128_4.to_json_file(f"{OUT}/preprocessor_config.json")

    # The torch path (float32), which transformers takes when torch is
    # installed, against the NumPy reference.
    try:
        import torch  # noqa: F401

        for name, fe in [("mel80_chunk5", fe80_5), ("mel128_chunk4", fe128_4)]:
            got = fe(speech, sampling_rate=sr, return_tensors="np")["input_features"][0]
            print(f"torch path vs NumPy path, {name}: max |diff| "
                  f"{np.abs(got - tensors[name]).max():.3g}")
    except ImportError:
        print("torch not installed: the torch path was not compared")
    with open(f"{OUT}/README.md", "w") as f:
        f.write("Made by tools/make_audio_fixtures.py (see its docstring); do not edit.\n")
    print(json.dumps({"written": sorted(os.listdir(OUT))}))


if __name__ == "__main__":
    main()
