"""The simulated driver of the rollout manager: the runtime's ``RolloutManager`` on a discrete-event
clock, with cost models in place of the engines, the trainer and the relays, read from
``conf.simulate.SimulateConfig`` (how it models them: docs/simulator.md). No Ray, torch or I/O."""

from training.rl.drivers.sim.calibrate import MAX_TRAIN_MFU, calibrate_train_share, simulate
from training.rl.drivers.sim.costs import CostModel
from training.rl.drivers.sim.lengths import LengthSampler, PromptSource
from training.rl.drivers.sim.placement import balanced_trainer_gpus
from training.rl.drivers.sim.results import ModeResult, format_table, speedups
from training.rl.drivers.sim.simulator import SIM_MODES, STREAM, Simulator

__all__ = [
    "MAX_TRAIN_MFU",
    "SIM_MODES",
    "STREAM",
    "CostModel",
    "LengthSampler",
    "ModeResult",
    "PromptSource",
    "Simulator",
    "balanced_trainer_gpus",
    "calibrate_train_share",
    "format_table",
    "simulate",
    "speedups",
]
