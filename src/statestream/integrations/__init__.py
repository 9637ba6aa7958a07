"""Integrations with training frameworks.

Each module imports its framework when it is imported itself, never from
``import statestream``:

- :mod:`statestream.integrations.lightning`: a PyTorch Lightning ``CheckpointIO``.
- :mod:`statestream.integrations.transformers`: a Hugging Face ``Trainer`` whose
  checkpoints statestream writes (``StatestreamTrainer``, or the
  ``StatestreamCheckpointing`` mixin).
"""
