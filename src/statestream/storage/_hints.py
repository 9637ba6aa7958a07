"""What a path that is not a checkpoint is instead, for error messages."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["manager_steps_hint", "not_a_checkpoint_hint"]

# the names a CheckpointManager gives its steps (see manager/_steps.py)
_STEP_RE = re.compile(r"^step_(\d{10,18})$")
_SHOWN = 8
# a transformers Trainer's checkpoint directories and, in those StatestreamTrainer
# writes, the statestream checkpoint inside (integrations/transformers.py)
_TRAINER_RE = re.compile(r"^checkpoint-(\d+)$")
_TRAINER_INNER = "statestream"


def manager_steps_hint(storage: Any, path: str) -> str | None:
    """If ``path`` is a CheckpointManager's directory, say so and list its committed steps.

    ``storage`` is the path's backend (its ``list`` and ``is_committed``); None
    when ``path`` holds no step checkpoints (or cannot be listed).
    """
    try:
        names = storage.list(path)
        steps = sorted(
            int(m.group(1)) for m in map(_STEP_RE.match, names)
            if m is not None and storage.is_committed(f"{path.rstrip('/')}/{m.group(0)}")
        )
    except Exception:  # only a hint: never hide the real error behind another
        return None
    if not steps:
        return None
    last = f"{path.rstrip('/')}/step_{steps[-1]:010d}"
    return (
        f"{path} is a CheckpointManager directory, not a checkpoint; its committed steps "
        f"are {_listed(steps)}. Load one with CheckpointManager({path!r}).load(step) or "
        f"statestream.load({last!r}) (`statestream inspect {last}`)"
    )


def trainer_hint(storage: Any, path: str) -> str | None:
    """If ``path`` is a ``checkpoint-<step>`` directory StatestreamTrainer wrote, or the
    Trainer's output directory holding such, name the statestream checkpoints in it."""
    root = path.rstrip("/")
    try:
        inner = f"{root}/{_TRAINER_INNER}"
        if storage.is_committed(inner):
            return (f"{path} is a transformers Trainer checkpoint (StatestreamTrainer), not a "
                    f"statestream checkpoint; the statestream checkpoint in it is {inner}")
        steps = sorted(
            int(m.group(1)) for m in map(_TRAINER_RE.match, storage.list(path))
            if m is not None and storage.is_committed(f"{root}/{m.group(0)}/{_TRAINER_INNER}")
        )
    except Exception:  # only a hint
        return None
    if not steps:
        return None
    last = f"{root}/checkpoint-{steps[-1]}/{_TRAINER_INNER}"
    return (f"{path} is a transformers Trainer output directory (StatestreamTrainer), not a "
            f"checkpoint; its checkpoints are at steps {_listed(steps)}, e.g. {last}")


def _listed(steps: list[int]) -> str:
    """The last steps of a sorted list, with how many earlier ones are not shown."""
    more = f"{len(steps) - _SHOWN} earlier and " if len(steps) > _SHOWN else ""
    return more + ", ".join(str(s) for s in steps[-_SHOWN:])


def not_a_checkpoint_hint(storage: Any, path: str) -> str | None:
    """What ``path``, which has no commit marker, is instead (None: nothing known)."""
    return manager_steps_hint(storage, path) or trainer_hint(storage, path)
