"""A tiny ImageFolder data set shaped like hymenoptera_data (ants/bees), for runs without real data.

``make_tiny_imagefolder(root)`` writes ``root/train/{ants,bees}/*.png`` and ``root/val/...``: small
RGB images that a model can tell apart (ants: dark red blobs on green, bees: yellow and black
stripes), so a loss curve from them goes down. Uses Pillow and NumPy (torchvision's dependencies).
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

CLASSES = ("ants", "bees")


def _image(label: str, size: int, rng: np.random.Generator) -> Image.Image:
    pixels = rng.integers(0, 40, size=(size, size, 3)).astype(np.int16)
    if label == "ants":
        pixels[..., 1] += 90  # green background
        for _ in range(3):
            cy, cx = rng.integers(0, size, 2)
            yy, xx = np.ogrid[:size, :size]
            blob = (yy - cy) ** 2 + (xx - cx) ** 2 <= (size // 6) ** 2
            pixels[blob] = (120, 20, 10)
    else:
        stripe = (np.arange(size) // max(1, size // 8)) % 2 == 0
        offset = int(rng.integers(0, size // 4 + 1))
        stripe = np.roll(stripe, offset)
        pixels[stripe, :, :2] += 200  # yellow
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def make_tiny_imagefolder(root: str, n_train: int = 8, n_val: int = 4, size: int = 32,
                          seed: int = 0) -> str:
    """Write the data set under ``root`` (``n_*`` images per class and split); returns ``root``."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", n_train), ("val", n_val)):
        for label in CLASSES:
            folder = os.path.join(root, split, label)
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                _image(label, size, rng).save(os.path.join(folder, f"{label}_{i:03d}.png"))
    return root
