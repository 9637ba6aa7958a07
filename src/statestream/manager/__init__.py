"""CheckpointManager and its save/keep policies."""

from statestream.manager._manager import CheckpointManager, ManagerLockedError
from statestream.manager._policies import (
    AllOf,
    AnyOf,
    AtSteps,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    KeepPolicy,
    KeepUnion,
    OnPreemption,
    SaveContext,
    SavePolicy,
    StepInfo,
)

__all__ = [
    "AllOf",
    "AnyOf",
    "AtSteps",
    "CheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "KeepPolicy",
    "KeepUnion",
    "ManagerLockedError",
    "OnPreemption",
    "SaveContext",
    "SavePolicy",
    "StepInfo",
]
