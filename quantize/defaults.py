"""Calibration defaults, in a module without torch so that the CLI's option defaults can read them."""

from __future__ import annotations

CALIB_SEED = 31_337  # the draw of a prompt format's calibration set (evaluation sets use other seeds)
CALIB_SIZE = 64  # calibration prompts by default (`--calib-size`)
