"""Finite checks of the training steps: a non-finite loss or gradient norm stops the stage.

Every optimizer step of the pipeline (warm-up SFT and RFT through ``training.sft.train_sft``, RL
through ``training.rl.trainer.PolicyTrainer.update``, DeepSpeed's included) calls
:func:`check_finite` on the step's loss before the backward pass and on its gradient norm before
the optimizer applies it, so a diverged step never reaches the weights that are published or
checkpointed. The error names the stage and step, the value and the config keys that usually
cause it (a learning rate far too high, clipping off).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from core.errors import StageError


class NonFiniteError(StageError):
    """A training step produced a non-finite loss or gradient norm; the stage publishes nothing."""


def describe_keys(keys: Mapping[str, object]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in keys.items())


def check_finite(where: str, keys: Mapping[str, object], **values: float | None) -> None:
    """Raise :class:`NonFiniteError` when one of ``values`` (``loss=...``, ``grad_norm=...``; None =
    not measured) is NaN or infinite. ``where``: the stage and step ("stage warmup, SFT step
    2/800"); ``keys``: the config keys to look at, with their values."""
    for name, value in values.items():
        if value is not None and not math.isfinite(value):
            what = name.replace("_", " ")
            raise NonFiniteError(
                f"{where}: the {what} is {value} (not finite), so training diverged; the stage stops "
                f"and publishes nothing. Lower the learning rate or clip gradients harder: "
                f"{describe_keys(keys)}"
            )
