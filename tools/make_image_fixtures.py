#!/usr/bin/env python3
"""Makes the image-input fixtures in tests/fixtures/images/.

Regenerate (Debian's Python for PIL 9.4 + transformers 4.46.3 from /work/pydeps):

    PYTHONPATH=/work/pydeps /usr/bin/python3 tools/make_image_fixtures.py

Writes:
  *.png, *.jpg                small committed images (PIL's encoders, plus a
                              hand-written PNG encoder for 16-bit and Adam7)
  configs/<name>.json         preprocessor_config.json variants
  expected.safetensors        tensors:
    decode/<file>             F16 [H, W, 3] what PIL's Image.open(f).convert("RGB")
                              gives (for the 16-bit gray PNG: its high byte,
                              see below), 0..255
    <config>/<file>           F32 [3, H, W] transformers' CLIPImageProcessor
                              pixel_values for that image and config

Pad-to-square configs ("image_aspect_ratio": "pad" as in LLaVA-1.5, or
LlavaImageProcessor's "do_pad") are computed the way LLaVA does it: PIL
expand2square with color int(mean * 255), then CLIPImageProcessor.

PIL converts a 16-bit grayscale PNG (mode "I") to RGB by clipping the 16-bit
value to 255, which turns almost every pixel white; troupe keeps the high
byte instead (as PIL does for 16-bit RGB). Its reference is therefore built
from the high byte, fed to CLIPImageProcessor as a uint8 array.
"""
import io
import json
import os
import struct
import sys
import zlib

import numpy as np
from PIL import Image, ImageDraw

import transformers
from transformers import CLIPImageProcessor

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "images")
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


# ------------------------------------------------------------ images

def scene(w, h, seed):
    """A gradient with a few flat shapes: small as PNG, varied for resampling."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1),
                  (x + y) * 255 // max(w + h - 2, 1)], axis=-1).astype(np.uint8)
    im = Image.fromarray(a, "RGB")
    d = ImageDraw.Draw(im)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, w - 4)), int(rng.integers(0, h - 4))
        x1, y1 = min(w - 1, x0 + int(rng.integers(3, w // 2 + 4))), min(h - 1, y0 + int(rng.integers(3, h // 2 + 4)))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = int(rng.integers(0, 3))
        if kind == 0:
            d.ellipse([x0, y0, x1, y1], fill=color)
        elif kind == 1:
            d.rectangle([x0, y0, x1, y1], fill=color)
        else:
            d.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=color)
    # One sharp checkerboard corner: ringing in bicubic shows up here.
    for i in range(0, min(12, h)):
        for j in range(0, min(12, w)):
            if (i // 3 + j // 3) % 2 == 0:
                im.putpixel((j, i), (255, 255, 255))
    return im


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path, a, color_type, bit_depth, interlace=False):
    """Minimal PNG encoder (filter 0) for what PIL cannot write: 16-bit RGB,
    16-bit gray and Adam7 interlacing. `a` is [H, W, C] of uint8/uint16."""
    h, w = a.shape[:2]
    dtype = ">u2" if bit_depth == 16 else "u1"

    def raw(sub):
        return b"".join(b"\x00" + sub[r].astype(dtype).tobytes() for r in range(sub.shape[0]))

    if interlace:
        passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
        data = b""
        for x0, y0, dx, dy in passes:
            sub = a[y0::dy, x0::dx]
            if sub.shape[0] and sub.shape[1]:
                data += raw(sub)
    else:
        data = raw(a)
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 1 if interlace else 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(data, 9)) +
                png_chunk(b"IEND", b""))


def make_images():
    files = {}  # name -> decoded RGB uint8 array (the reference decode)

    def save(name, im, **kw):
        im.save(os.path.join(OUT, name), **kw)

    save("shapes_97x61.png", scene(97, 61, 1), optimize=True)
    save("large_300x200.png", scene(300, 200, 2), optimize=True)
    save("small_20x14.png", scene(20, 14, 3))
    save("gray_50x70.png", scene(50, 70, 4).convert("L"))
    rgba = scene(64, 48, 5).convert("RGBA")
    alpha = np.tile(np.linspace(0, 255, 64).astype(np.uint8), (48, 1))
    rgba.putalpha(Image.fromarray(alpha, "L"))
    save("rgba_64x48.png", rgba)
    la = scene(30, 36, 6).convert("LA")
    save("gray_alpha_30x36.png", la)
    pal = scene(40, 30, 7).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.info["transparency"] = 3
    save("palette_40x30.png", pal, transparency=3)
    save("bilevel_24x20.png", scene(24, 20, 8).convert("1"))
    rgb16 = np.asarray(scene(33, 45, 9)).astype(np.uint16) * 257 + np.arange(33, dtype=np.uint16)[None, :, None]
    write_png(os.path.join(OUT, "rgb16_33x45.png"), rgb16, 2, 16)
    gray16 = (np.asarray(scene(21, 17, 10).convert("L")).astype(np.uint16) * 256 + 77)[..., None]
    write_png(os.path.join(OUT, "gray16_21x17.png"), gray16, 0, 16)
    write_png(os.path.join(OUT, "interlaced_45x31.png"), np.asarray(scene(45, 31, 11)), 2, 8, interlace=True)
    save("photo_80x120.jpg", scene(80, 120, 12), quality=90)
    save("progressive_96x64.jpg", scene(96, 64, 13), quality=85, progressive=True)
    save("subsampling444_50x40.jpg", scene(50, 40, 14), quality=92, subsampling=0)
    save("gray_60x40.jpg", scene(60, 40, 15).convert("L"), quality=90)
    save("cmyk_40x32.jpg", scene(40, 32, 16).convert("CMYK"), quality=95)

    for name in sorted(os.listdir(OUT)):
        if not (name.endswith(".png") or name.endswith(".jpg")):
            continue
        path = os.path.join(OUT, name)
        size = os.path.getsize(path)
        assert size < 20 * 1024, f"{name} is {size} bytes"
        if name.startswith("gray16"):
            files[name] = np.repeat((gray16[..., 0] >> 8).astype(np.uint8)[..., None], 3, axis=2)
        else:
            files[name] = np.asarray(Image.open(path).convert("RGB"))
        print(f"{name}: {size} bytes, {Image.open(path).mode}")
    return files


# ------------------------------------------------------------ configs

CONFIGS = {
    # The bundled tiny LLaVA's preprocessor.
    "clip64": {
        "crop_size": {"height": 64, "width": 64}, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": CLIP_MEAN,
        "image_processor_type": "CLIPImageProcessor", "image_std": CLIP_STD, "processor_class": "LlavaProcessor",
        "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 64},
    },
    # openai/clip-vit-large-patch14-336 as published (old int-valued form).
    "clip336": {
        "crop_size": 336, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "resample": 3, "size": 336,
    },
    # LLaVA-1.5 style: pad to a square of the mean color, then CLIP.
    "pad64": {
        "image_processor_type": "LlavaImageProcessor", "do_pad": True, "crop_size": {"height": 64, "width": 64},
        "resample": 3, "size": {"shortest_edge": 64}, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
    },
    # Exact size, bilinear, a crop taller than the image (zero padding),
    # scalar mean/std.
    "hw_bilinear": {
        "image_processor_type": "CLIPImageProcessor", "size": {"height": 50, "width": 70}, "resample": 2,
        "crop_size": {"height": 64, "width": 60}, "image_mean": 0.5, "image_std": 0.5,
    },
    # No resize, crop only, no rescale: normalize in pixel units.
    "crop_only": {
        "do_resize": False, "crop_size": [40, 24], "do_rescale": False,
        "image_mean": [120.0, 110.0, 100.0], "image_std": [60.0, 50.0, 40.0],
    },
}
PAD = {"pad64"}
ONLY = {"clip336": {"shapes_97x61.png"}}  # 1.35 MB each: one is enough


def expand2square(im, color):
    w, h = im.size
    if w == h:
        return im
    side = max(w, h)
    out = Image.new(im.mode, (side, side), color)
    out.paste(im, (0, (side - h) // 2) if w > h else ((side - w) // 2, 0))
    return out


def reference(config_name, rgb):
    cfg = CONFIGS[config_name]
    proc = CLIPImageProcessor.from_dict({k: v for k, v in cfg.items() if k not in ("do_pad", "image_processor_type")})
    im = Image.fromarray(rgb, "RGB")
    if config_name in PAD:
        im = expand2square(im, tuple(int(x * 255) for x in proc.image_mean))
    return proc(images=im, return_tensors="np")["pixel_values"][0].astype(np.float32)


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        # Decoded pixels are integers 0..255: exact in F16.
        half = name.startswith("decode/")
        a = np.ascontiguousarray(tensors[name], dtype="<f2" if half else "<f4")
        b = a.tobytes()
        header[name] = {"dtype": "F16" if half else "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    header["__metadata__"] = {"generator": "tools/make_image_fixtures.py",
                              "transformers": transformers.__version__, "PIL": Image.__version__}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    os.makedirs(os.path.join(OUT, "configs"), exist_ok=True)
    files = make_images()
    tensors = {}
    for name, rgb in files.items():
        tensors[f"decode/{name}"] = rgb.astype(np.float32)
    for cname, cfg in CONFIGS.items():
        with open(os.path.join(OUT, "configs", cname + ".json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        for name, rgb in files.items():
            if cname in ONLY and name not in ONLY[cname]:
                continue
            if cname in PAD and rgb.shape[0] == rgb.shape[1]:
                continue
            tensors[f"{cname}/{name}"] = reference(cname, rgb)
    write_safetensors(os.path.join(OUT, "expected.safetensors"), tensors)
    print(f"{len(tensors)} tensors, {os.path.getsize(os.path.join(OUT, 'expected.safetensors'))} bytes")


if __name__ == "__main__":
    sys.exit(main())
