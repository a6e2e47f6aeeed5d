"""Frames of an episode drawn from its observations (no simulator state, no display needed), saved as a GIF.

Classic-control observations fully describe what Gymnasium draws, so each frame is a few PIL shapes: CartPole
`[x, x_dot, theta, theta_dot]`, Pendulum `[cos, sin, theta_dot]`, Acrobot `[cos1, sin1, cos2, sin2, v1, v2]`.
Grid observations (MinAtar `(10, 10, C)`, bsuite `(H, W)`) are drawn as coloured cells, one colour per channel.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from systolic.errors import UserError

SIZE = 300  # pixels, square frames


def _cartpole(obs: np.ndarray, draw) -> None:
    x, _, theta, _ = (float(v) for v in obs[:4])
    scale = SIZE / 4.8  # the track is +-2.4 world units
    ground = SIZE * 0.7
    cart_x = SIZE / 2 + x * scale
    draw.line([(0, ground), (SIZE, ground)], fill=(0, 0, 0), width=1)
    draw.rectangle([cart_x - 25, ground - 15, cart_x + 25, ground + 15], fill=(40, 40, 40))
    pole = 1.0 * scale  # the pole's full length is 2 x its half-length 0.5
    tip = (cart_x + pole * math.sin(theta), ground - 15 - pole * math.cos(theta))
    draw.line([(cart_x, ground - 15), tip], fill=(202, 152, 101), width=8)
    draw.ellipse([cart_x - 4, ground - 19, cart_x + 4, ground - 11], fill=(129, 132, 203))


def _pendulum(obs: np.ndarray, draw) -> None:
    cos, sin = float(obs[0]), float(obs[1])
    c, length = SIZE / 2, SIZE * 0.38
    tip = (c + length * sin, c - length * cos)  # theta = 0 is upright
    draw.line([(c, c), tip], fill=(204, 77, 77), width=14)
    draw.ellipse([c - 6, c - 6, c + 6, c + 6], fill=(0, 0, 0))


def _acrobot(obs: np.ndarray, draw) -> None:
    c1, s1, c2, s2 = (float(v) for v in obs[:4])
    c12, s12 = c1 * c2 - s1 * s2, s1 * c2 + c1 * s2  # cos/sin of the summed angles
    c, link = SIZE / 2, SIZE * 0.22
    p1 = (c + link * s1, c + link * c1)  # angle 0 hangs straight down
    p2 = (p1[0] + link * s12, p1[1] + link * c12)
    draw.line([(0, c - 2 * link), (SIZE, c - 2 * link)], fill=(0, 0, 0), width=1)  # the goal height
    draw.line([(c, c), p1], fill=(0, 204, 204), width=8)
    draw.line([p1, p2], fill=(0, 204, 204), width=8)
    for p in ((c, c), p1):
        draw.ellipse([p[0] - 5, p[1] - 5, p[0] + 5, p[1] + 5], fill=(204, 204, 0))


_PALETTE = np.array([[230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200], [245, 130, 48], [145, 30, 180],
                     [70, 240, 240], [240, 50, 230], [210, 245, 60], [250, 190, 212]], np.float32)


def _grid(obs: np.ndarray):
    from PIL import Image

    grid = obs if obs.ndim == 3 else obs[..., None]  # (H, W, C)
    colors = _PALETTE[np.arange(grid.shape[-1]) % len(_PALETTE)]  # (C, 3)
    weights = np.clip(grid, 0, 1)
    rgb = 255 - np.clip(np.einsum("hwc,cd->hwd", weights, 255 - colors), 0, 255)  # white background
    cell = max(1, SIZE // max(grid.shape[:2]))
    return Image.fromarray(rgb.astype(np.uint8)).resize((grid.shape[1] * cell, grid.shape[0] * cell),
                                                         Image.NEAREST)


_DRAWERS = {"CartPole-v1": _cartpole, "Pendulum-v1": _pendulum, "Acrobot-v1": _acrobot}


def check_renderable(env_name: str, obs_shape: tuple[int, ...]) -> None:
    if env_name not in _DRAWERS and len(obs_shape) not in (2, 3):
        raise UserError(f"--gif: no renderer for {env_name} (observations of shape {obs_shape}). Frames can be "
                        "drawn for CartPole-v1, Pendulum-v1, Acrobot-v1 and grid environments (MinAtar, bsuite). "
                        "Fix: drop --gif for this run.")


def frame(env_name: str, obs: np.ndarray):
    """One PIL image of the observation."""
    from PIL import Image, ImageDraw

    if env_name in _DRAWERS:
        image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
        _DRAWERS[env_name](np.asarray(obs), ImageDraw.Draw(image))
        return image
    return _grid(np.asarray(obs))


def save_gif(env_name: str, observations: np.ndarray, path: Path, *, fps: int = 25) -> Path:
    """observations (T, *obs_shape) -> an animated GIF at `path`."""
    check_renderable(env_name, observations.shape[1:])
    frames = [frame(env_name, o) for o in observations]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # whole or not at all
    frames[0].save(tmp, format="GIF", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    os.replace(tmp, path)
    return path
